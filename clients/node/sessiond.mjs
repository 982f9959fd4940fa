// A small sessiond client for Node, written from docs/protocol.md: framing,
// the handshake, requests matched by id, a turn's events as an async
// iterator.  Node's standard library only (and ./msgpack.mjs).
//
//   const client = await Client.connect('/run/sessiond/sessiond.sock');
//   const session = await client.create({ handler: 'echo' });
//   for await (const ev of client.send(session.id, 'hello')) { ... }

import net from 'node:net';
import { encode, decode } from './msgpack.mjs';

export const PROTOCOL = 1;
const MAX_FRAME = 1 << 30;

export class SessiondError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

export class Client {
  constructor(socket) {
    this.socket = socket;
    this.nextId = 1;
    this.pending = new Map(); // id -> {resolve, reject}
    this.streams = new Map(); // session -> Set of event sinks
    this.buffer = Buffer.alloc(0);
    this.closed = false;
    socket.on('data', (chunk) => this.onData(chunk));
    socket.on('close', () => this.onClose(new Error('connection to sessiond closed')));
    socket.on('error', (err) => this.onClose(err));
  }

  static connect(path, { client = 'node-example' } = {}) {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection(path);
      socket.once('error', reject);
      socket.once('connect', () => {
        socket.off('error', reject);
        const c = new Client(socket);
        // The welcome answers no request id: it is the reply to id 0.
        c.pending.set(0, {
          resolve: (welcome) => { c.server = welcome; resolve(c); },
          reject,
        });
        c.write({ type: 'hello', protocol: PROTOCOL, client, error_codes: ['no_space'] });
      });
    });
  }

  close() {
    this.socket.end();
  }

  write(msg) {
    const body = encode(msg);
    const head = Buffer.alloc(4);
    head.writeUInt32BE(body.length, 0);
    this.socket.write(Buffer.concat([head, body]));
  }

  onData(chunk) {
    this.buffer = Buffer.concat([this.buffer, chunk]);
    while (this.buffer.length >= 4) {
      const length = this.buffer.readUInt32BE(0);
      if (length > MAX_FRAME) return this.onClose(new Error(`frame of ${length} bytes`));
      if (this.buffer.length < 4 + length) break;
      const msg = decode(this.buffer.subarray(4, 4 + length));
      this.buffer = this.buffer.subarray(4 + length);
      this.dispatch(msg);
    }
  }

  dispatch(msg) {
    if (!('id' in msg) && msg.type !== 'welcome' && msg.type !== 'error') {
      // An event (no id): to whoever follows its session; `lagged` to all.
      const sinks = msg.type === 'lagged' ? [...this.streams.values()].flatMap((s) => [...s])
        : [...(this.streams.get(msg.session) || [])];
      for (const sink of sinks) sink(msg);
      return;
    }
    const id = msg.type === 'welcome' ? 0 : (msg.id ?? 0);
    const waiter = this.pending.get(id);
    if (!waiter) return;
    this.pending.delete(id);
    if (msg.type === 'error') waiter.reject(new SessiondError(msg.code, msg.message));
    else waiter.resolve(msg);
  }

  onClose(err) {
    if (this.closed) return;
    this.closed = true;
    for (const waiter of this.pending.values()) waiter.reject(err);
    this.pending.clear();
    for (const sinks of this.streams.values()) for (const sink of sinks) sink({ type: 'closed', error: err });
  }

  request(type, fields = {}) {
    if (this.closed) return Promise.reject(new Error('connection to sessiond is closed'));
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.write({ type, id, ...fields });
    });
  }

  async create({ session = null, handler = null, settings = {} } = {}) {
    const reply = await this.request('create', { session, handler, settings });
    return reply.session;
  }

  status(session) {
    return this.request('status', { session }).then((r) => r.session);
  }

  remove(session) {
    return this.request('rm', { session });
  }

  // The events of one turn, in order: `accepted` is awaited first (the
  // protocol sends the turn's events after it), the last event is the
  // turn's `turn_done` or `turn_failed`.  Throws SessiondError if the input
  // is refused.
  async *send(session, text) {
    const queue = [];
    let wake = null;
    const sink = (ev) => { queue.push(ev); if (wake) { wake(); wake = null; } };
    if (!this.streams.has(session)) this.streams.set(session, new Set());
    this.streams.get(session).add(sink);
    try {
      const accepted = await this.request('send', { session, text });
      for (;;) {
        if (queue.length === 0) await new Promise((resolve) => { wake = resolve; });
        const ev = queue.shift();
        if (ev.type === 'closed') throw ev.error;
        if (ev.type === 'lagged') throw new Error('this client fell behind and was disconnected');
        if (ev.seq <= accepted.seq) continue; // an event from before this turn
        yield ev;
        if ((ev.type === 'turn_done' || ev.type === 'turn_failed') && ev.turn === accepted.turn) return;
      }
    } finally {
      this.streams.get(session)?.delete(sink);
    }
  }
}
