// The part of msgpack (https://github.com/msgpack/msgpack/blob/master/spec.md)
// that sessiond's control protocol uses: nil, booleans, integers, floats,
// strings, binary, arrays and maps with string keys.  Written from the spec
// so that this client needs nothing but Node itself.

const textEncoder = new TextEncoder();
const textDecoder = new TextDecoder('utf-8', { fatal: true });

export function encode(value) {
  const out = [];
  write(value, out);
  return Buffer.concat(out);
}

function header(byte, size, length) {
  const b = Buffer.alloc(1 + size);
  b[0] = byte;
  if (size === 1) b.writeUInt8(length, 1);
  else if (size === 2) b.writeUInt16BE(length, 1);
  else if (size === 4) b.writeUInt32BE(length, 1);
  return b;
}

function sized(length, small, codes, out) {
  // codes: [8-bit, 16-bit, 32-bit] type bytes; small: the fix form or null
  if (small !== null && length < 16) out.push(Buffer.from([small | length]));
  else if (codes[0] !== null && length < 0x100) out.push(header(codes[0], 1, length));
  else if (length < 0x10000) out.push(header(codes[1], 2, length));
  else out.push(header(codes[2], 4, length));
}

function writeInt(n, out) {
  if (n >= 0 && n < 0x80) return out.push(Buffer.from([n]));
  if (n < 0 && n >= -32) return out.push(Buffer.from([n & 0xff]));
  const b = Buffer.alloc(9);
  if (n >= 0) {
    if (n < 0x100) { b[0] = 0xcc; b.writeUInt8(n, 1); return out.push(b.subarray(0, 2)); }
    if (n < 0x10000) { b[0] = 0xcd; b.writeUInt16BE(n, 1); return out.push(b.subarray(0, 3)); }
    if (n < 0x100000000) { b[0] = 0xce; b.writeUInt32BE(n, 1); return out.push(b.subarray(0, 5)); }
    b[0] = 0xcf; b.writeBigUInt64BE(BigInt(n), 1); return out.push(b);
  }
  if (n >= -0x80) { b[0] = 0xd0; b.writeInt8(n, 1); return out.push(b.subarray(0, 2)); }
  if (n >= -0x8000) { b[0] = 0xd1; b.writeInt16BE(n, 1); return out.push(b.subarray(0, 3)); }
  if (n >= -0x80000000) { b[0] = 0xd2; b.writeInt32BE(n, 1); return out.push(b.subarray(0, 5)); }
  b[0] = 0xd3; b.writeBigInt64BE(BigInt(n), 1); return out.push(b);
}

function write(value, out) {
  if (value === null || value === undefined) {
    out.push(Buffer.from([0xc0]));
  } else if (value === true || value === false) {
    out.push(Buffer.from([value ? 0xc3 : 0xc2]));
  } else if (typeof value === 'number') {
    if (Number.isSafeInteger(value)) {
      writeInt(value, out);
    } else {
      const b = Buffer.alloc(9);
      b[0] = 0xcb;
      b.writeDoubleBE(value, 1);
      out.push(b);
    }
  } else if (typeof value === 'bigint') {
    const b = Buffer.alloc(9);
    if (value >= 0n) { b[0] = 0xcf; b.writeBigUInt64BE(value, 1); } else { b[0] = 0xd3; b.writeBigInt64BE(value, 1); }
    out.push(b);
  } else if (typeof value === 'string') {
    const bytes = Buffer.from(textEncoder.encode(value));
    if (bytes.length < 32) out.push(Buffer.from([0xa0 | bytes.length]));
    else sized(bytes.length, null, [0xd9, 0xda, 0xdb], out);
    out.push(bytes);
  } else if (value instanceof Uint8Array) {
    sized(value.length, null, [0xc4, 0xc5, 0xc6], out);
    out.push(Buffer.from(value));
  } else if (Array.isArray(value)) {
    sized(value.length, 0x90, [null, 0xdc, 0xdd], out);
    for (const item of value) write(item, out);
  } else if (typeof value === 'object') {
    const entries = Object.entries(value).filter(([, v]) => v !== undefined);
    sized(entries.length, 0x80, [null, 0xde, 0xdf], out);
    for (const [k, v] of entries) { write(k, out); write(v, out); }
  } else {
    throw new TypeError(`cannot encode a ${typeof value} in msgpack`);
  }
}

export function decode(buf) {
  const reader = { buf, pos: 0 };
  const value = read(reader);
  if (reader.pos !== buf.length) throw new Error('msgpack: trailing bytes after the value');
  return value;
}

function need(r, n) {
  if (r.pos + n > r.buf.length) throw new Error('msgpack: truncated value');
}

function take(r, n) {
  need(r, n);
  const slice = r.buf.subarray(r.pos, r.pos + n);
  r.pos += n;
  return slice;
}

function u(r, size) {
  need(r, size);
  const b = r.buf;
  const p = r.pos;
  r.pos += size;
  if (size === 1) return b.readUInt8(p);
  if (size === 2) return b.readUInt16BE(p);
  return b.readUInt32BE(p);
}

function big(value) {
  // An integer past 2**53 stays exact as a BigInt.
  return value >= BigInt(Number.MIN_SAFE_INTEGER) && value <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(value) : value;
}

function readArray(r, n) {
  const items = new Array(n);
  for (let i = 0; i < n; i++) items[i] = read(r);
  return items;
}

function readMap(r, n) {
  const obj = {};
  for (let i = 0; i < n; i++) {
    const key = read(r);
    obj[typeof key === 'string' ? key : String(key)] = read(r);
  }
  return obj;
}

function read(r) {
  const byte = u(r, 1);
  if (byte < 0x80) return byte;
  if (byte >= 0xe0) return byte - 0x100;
  if ((byte & 0xf0) === 0x80) return readMap(r, byte & 0x0f);
  if ((byte & 0xf0) === 0x90) return readArray(r, byte & 0x0f);
  if ((byte & 0xe0) === 0xa0) return textDecoder.decode(take(r, byte & 0x1f));
  let v;
  switch (byte) {
    case 0xc0: return null;
    case 0xc2: return false;
    case 0xc3: return true;
    case 0xc4: return Buffer.from(take(r, u(r, 1)));
    case 0xc5: return Buffer.from(take(r, u(r, 2)));
    case 0xc6: return Buffer.from(take(r, u(r, 4)));
    case 0xca: need(r, 4); v = r.buf.readFloatBE(r.pos); r.pos += 4; return v;
    case 0xcb: need(r, 8); v = r.buf.readDoubleBE(r.pos); r.pos += 8; return v;
    case 0xcc: return u(r, 1);
    case 0xcd: return u(r, 2);
    case 0xce: return u(r, 4);
    case 0xcf: need(r, 8); v = r.buf.readBigUInt64BE(r.pos); r.pos += 8; return big(v);
    case 0xd0: need(r, 1); v = r.buf.readInt8(r.pos); r.pos += 1; return v;
    case 0xd1: need(r, 2); v = r.buf.readInt16BE(r.pos); r.pos += 2; return v;
    case 0xd2: need(r, 4); v = r.buf.readInt32BE(r.pos); r.pos += 4; return v;
    case 0xd3: need(r, 8); v = r.buf.readBigInt64BE(r.pos); r.pos += 8; return big(v);
    case 0xd9: return textDecoder.decode(take(r, u(r, 1)));
    case 0xda: return textDecoder.decode(take(r, u(r, 2)));
    case 0xdb: return textDecoder.decode(take(r, u(r, 4)));
    case 0xdc: return readArray(r, u(r, 2));
    case 0xdd: return readArray(r, u(r, 4));
    case 0xde: return readMap(r, u(r, 2));
    case 0xdf: return readMap(r, u(r, 4));
    default: throw new Error(`msgpack: type byte 0x${byte.toString(16)} is not used by sessiond`);
  }
}
