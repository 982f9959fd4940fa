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

export class InputUnacknowledged extends Error {
  // The daemon went away after an input was sent and before it said the
  // input was kept: taken or not, nobody knows.  It is never sent again.
  constructor(session, cause) {
    super(`connection to sessiond lost before it acknowledged the input to ${session}: it may or may not `
      + 'have been taken, and is not sent again (`history` shows whether it was)');
    this.session = session;
    this.cause = cause;
  }
}

// Turns of a session's history read back after a reconnect, to learn how
// a turn ended when its end was not retained.
const HISTORY_TURNS = 16;

export class Client {
  // Use Client.connect.  `reconnectSecs`: how long a stream (a `send`'s
  // turn) that lost the daemon reconnects before it gives up (0: not at
  // all); `onReconnect(line)` is told, in words, when it does.
  constructor(path, { client = 'node-example', reconnectSecs = 30, onReconnect = null } = {}) {
    this.path = path;
    this.name = client;
    this.reconnectSecs = reconnectSecs;
    this.onReconnect = onReconnect;
    this.nextId = 1;
    this.pending = new Map(); // id -> {resolve, reject}
    this.streams = new Map(); // session -> Set of event sinks
    this.socket = null;
    this.closed = true;
    this.shut = false;
    this.redialing = null;
  }

  static async connect(path, options = {}) {
    const c = new Client(path, options);
    await c.dial();
    return c;
  }

  // Connect and say hello; resolves once the daemon's welcome came.  A
  // refusal (its `error`, sent before or after our hello) rejects with it.
  dial() {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection(this.path);
      let welcomed = false;
      let buffer = Buffer.alloc(0);
      let refused = null;
      const fail = (err) => { if (!welcomed) reject(refused || err); };
      socket.on('error', (err) => (welcomed ? this.onClose(socket, err) : fail(err)));
      socket.on('close', () => (welcomed ? this.onClose(socket, new Error('connection to sessiond closed'))
        : fail(new Error('sessiond closed the connection before answering hello'))));
      socket.on('data', (chunk) => {
        buffer = Buffer.concat([buffer, chunk]);
        while (buffer.length >= 4) {
          const length = buffer.readUInt32BE(0);
          if (length > MAX_FRAME) { socket.destroy(new Error(`frame of ${length} bytes`)); return; }
          if (buffer.length < 4 + length) break;
          const msg = decode(buffer.subarray(4, 4 + length));
          buffer = buffer.subarray(4 + length);
          if (welcomed) this.dispatch(msg);
          else if (msg.type === 'welcome') {
            welcomed = true;
            this.socket = socket;
            this.closed = false;
            this.server = msg;
            resolve(msg);
          } else if (msg.type === 'error') refused = new SessiondError(msg.code, msg.message);
        }
      });
      socket.once('connect', () => {
        this.writeTo(socket, { type: 'hello', protocol: PROTOCOL, client: this.name, error_codes: ['no_space'] });
      });
    });
  }

  close() {
    this.shut = true;
    this.socket?.end();
  }

  writeTo(socket, msg) {
    const body = encode(msg);
    const head = Buffer.alloc(4);
    head.writeUInt32BE(body.length, 0);
    socket.write(Buffer.concat([head, body]));
  }

  dispatch(msg) {
    if (!('id' in msg) && msg.type !== 'welcome' && msg.type !== 'error') {
      // An event (no id): to whoever follows its session.  `lagged`: the
      // daemon cut us off for falling behind; the streams attach again.
      if (msg.type === 'lagged') { this.socket.destroy(); return; }
      for (const sink of [...(this.streams.get(msg.session) || [])]) sink(msg);
      return;
    }
    const waiter = this.pending.get(msg.id ?? 0);
    if (!waiter) return;
    this.pending.delete(msg.id ?? 0);
    if (msg.type === 'error') waiter.reject(new SessiondError(msg.code, msg.message));
    else waiter.resolve(msg);
  }

  onClose(socket, err) {
    if (socket !== this.socket || this.closed) return;
    this.closed = true;
    for (const waiter of this.pending.values()) waiter.reject(err);
    this.pending.clear();
    for (const sinks of this.streams.values()) for (const sink of sinks) sink({ type: 'closed', error: err });
  }

  // Connected again (at once if connected): one reconnection, with
  // backoff, shared by whoever waits; rejects once reconnectSecs are over.
  reconnected() {
    if (!this.closed) return Promise.resolve();
    if (this.shut) return Promise.reject(new Error('this client was closed'));
    if (!(this.reconnectSecs > 0)) return Promise.reject(new Error('connection to sessiond is closed'));
    if (!this.redialing) {
      this.redialing = this.redial().finally(() => { this.redialing = null; });
    }
    return this.redialing;
  }

  async redial() {
    const deadline = Date.now() + this.reconnectSecs * 1000;
    let delay = 50;
    this.onReconnect?.(`connection to sessiond lost; reconnecting for up to ${this.reconnectSecs}s`);
    for (;;) {
      let why;
      try {
        await this.dial();
        this.onReconnect?.(`reconnected to sessiond (pid ${this.server.pid})`);
        return;
      } catch (err) {
        if (err instanceof SessiondError && err.code !== 'capacity') throw err;
        why = err.message;
      }
      if (Date.now() + delay >= deadline) {
        throw new Error(`sessiond did not come back within ${this.reconnectSecs}s (${why})`);
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 1000);
    }
  }

  async request(type, fields = {}) {
    if (this.closed) await this.reconnected();
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.writeTo(this.socket, { type, id, ...fields });
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

  follow(session) {
    const queue = [];
    const stream = { queue, wake: null };
    stream.sink = (ev) => { queue.push(ev); if (stream.wake) { stream.wake(); stream.wake = null; } };
    if (!this.streams.has(session)) this.streams.set(session, new Set());
    this.streams.get(session).add(stream.sink);
    stream.next = async () => {
      if (queue.length === 0) await new Promise((resolve) => { stream.wake = resolve; });
      return queue.shift();
    };
    return stream;
  }

  unfollow(session, stream) {
    this.streams.get(session)?.delete(stream.sink);
  }

  // The events of one turn, in order: `accepted` is awaited first (the
  // protocol sends the turn's events after it), the last event is the
  // turn's `turn_done` or `turn_failed`.  Throws SessiondError if the input
  // is refused, InputUnacknowledged if the daemon went away before it said.
  // Once the input is acknowledged the turn is followed to its end across
  // a daemon restart: reconnected, attached again from the last event seen
  // (a `gap` says what was not retained) and, if its end was not retained,
  // ended with the turn_done or turn_failed that the session's history
  // keeps (seq 0: read back, not an event the daemon sent).
  async *send(session, text) {
    let stream = this.follow(session);
    try {
      let accepted;
      try {
        accepted = await this.request('send', { session, text });
      } catch (err) {
        if (err instanceof SessiondError) throw err;
        throw new InputUnacknowledged(session, err);
      }
      const turn = accepted.turn;
      let last = accepted.seq;
      let stored = null;
      for (;;) {
        if (stored && stream.queue.length === 0) { yield stored; return; }
        const ev = await stream.next();
        if (ev.type === 'closed') {
          this.unfollow(session, stream);
          [stream, stored] = await this.refollow(session, last, turn);
          continue;
        }
        if (ev.seq <= last) continue; // an event from before this turn, or seen
        last = ev.type === 'gap' ? ev.seq - 1 : ev.seq;
        yield ev;
        if ((ev.type === 'turn_done' || ev.type === 'turn_failed') && ev.turn === turn) return;
      }
    } finally {
      this.unfollow(session, stream);
    }
  }

  async refollow(session, last, turn) {
    for (;;) {
      try {
        await this.reconnected();
      } catch (err) {
        if (err instanceof SessiondError) throw err;
        throw new Error(`${err.message}; turn ${turn} of ${session} goes on in the daemon if it comes back`);
      }
      const stream = this.follow(session);
      try {
        await this.request('attach', { session, from_seq: last + 1 });
        const history = await this.request('history', { session, limit: HISTORY_TURNS });
        return [stream, storedEnd(history, session, turn)];
      } catch (err) {
        this.unfollow(session, stream);
        if (err instanceof SessiondError) throw err; // e.g. not_found: gone when the daemon came back
      }
    }
  }
}

// How `turn` ended as the session's history keeps it: its turn_done or
// turn_failed (seq 0), or null while it is open.
function storedEnd(history, session, turn) {
  for (const t of history.turns ?? []) {
    if (t.turn !== turn) continue;
    if (t.outcome === 'done') {
      return { type: 'turn_done', session, seq: 0, turn, reply: t.reply ?? '', interrupted: t.interrupted ?? false,
        stop_reason: t.stop_reason ?? '', stop_detail: t.stop_detail ?? '', usage: t.usage ?? {} };
    }
    if (t.outcome === 'aborted') return { type: 'turn_failed', session, seq: 0, turn, reason: t.reason ?? '' };
    return null;
  }
  throw new Error(`turn ${turn} of ${session} ended while the connection was lost, and its end is no longer `
    + 'kept event by event: `history` shows what is');
}
