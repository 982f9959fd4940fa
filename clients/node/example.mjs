// A session created, a turn streamed, an error handled: sessiond from Node.
//
//   node clients/node/example.mjs [--socket PATH] [--handler echo] [TEXT]
//
// The socket: --socket, else $SESSIOND_SOCKET, else /run/sessiond/sessiond.sock.
// tests/test_node_client.py runs it against a real daemon in `make test`.

import { Client, SessiondError } from './sessiond.mjs';

const args = process.argv.slice(2);
function option(name, fallback) {
  const i = args.indexOf(name);
  if (i < 0) return fallback;
  const [, value] = args.splice(i, 2);
  return value;
}
const socketPath = option('--socket', process.env.SESSIOND_SOCKET || '/run/sessiond/sessiond.sock');
const handler = option('--handler', 'echo');
const text = args[0] ?? 'hello from node';

const client = await Client.connect(socketPath);
console.log(`connected: sessiond ${client.server.server_version} (pid ${client.server.pid})`);
try {
  const session = await client.create({ handler });
  console.log(`created: ${session.id} (${session.state})`);

  process.stdout.write('reply: ');
  let ending = null;
  for await (const ev of client.send(session.id, text)) {
    if (ev.type === 'text') process.stdout.write(ev.text);
    else if (ev.type === 'turn_done' || ev.type === 'turn_failed') ending = ev;
  }
  process.stdout.write('\n');
  if (ending.type === 'turn_done') console.log(`turn ${ending.turn} done`);
  else console.log(`turn ${ending.turn} failed: ${ending.reason}`);

  // An error is a reply like any other: its code says what went wrong.
  try {
    await client.status('no-such-session');
  } catch (err) {
    if (!(err instanceof SessiondError)) throw err;
    console.log(`error handled: ${err.code}: ${err.message}`);
  }

  await client.remove(session.id);
  console.log(`removed: ${session.id}`);
} finally {
  client.close();
}
