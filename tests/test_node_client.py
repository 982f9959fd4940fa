"""The Node client (clients/node/) against a real daemon: its example
creates a session, streams a turn and handles an error; its msgpack
encodes byte for byte what the reference `msgpack` package does and
decodes it back.  Node is a test dependency (`make system-deps` installs
it): without it these tests fail saying what to install, as the
PostgreSQL ones do; they are never skipped."""

from __future__ import annotations

import json
import shutil
import subprocess

import msgpack
import pytest

from harness import REPO

pytestmark = pytest.mark.process

NODE_DIR = REPO / "clients" / "node"
_INSTALL_HINT = ("node (Node.js 18 or later) was not found: install it (Debian/Ubuntu: apt-get install nodejs; "
                 "`make system-deps` does it as root), then run the tests again")


def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.fail(_INSTALL_HINT, pytrace=False)
    return found


def test_the_example_creates_a_session_streams_a_turn_and_handles_an_error(make_daemon) -> None:
    d = make_daemon()
    done = subprocess.run([node(), str(NODE_DIR / "example.mjs"), "--socket", str(d.socket), "hi there"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"connected: sessiond {d.client().stats().version} (pid {d.pid})"
    created = lines[1].split()
    assert created[0] == "created:" and created[2] == "(idle)"
    assert lines[2] == "reply: 1: hi there"  # streamed piece by piece
    assert lines[3] == "turn 1 done"
    assert lines[4] == "error handled: not_found: no session 'no-such-session'"
    assert lines[5] == f"removed: {created[1]}"
    with d.client() as c:
        assert c.list() == []


SAMPLES = [
    None, True, False, 0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**53 - 1, -1, -32, -33, -128, -129,
    -32768, -32769, -(2**31), -(2**31) - 1, 1.5, -0.25, "", "é", "x" * 31, "y" * 32, "z" * 256, "w" * 65536,
    [], [1, [2, 3]], list(range(16)), {"type": "send", "id": 7, "session": "s", "text": "hi"},
    {f"k{i}": i for i in range(16)},
]


def test_its_msgpack_matches_the_reference_both_ways() -> None:
    script = (
        "import { encode, decode } from './msgpack.mjs';\n"
        "import { readFileSync } from 'node:fs';\n"
        "const values = JSON.parse(readFileSync(0, 'utf8'));\n"
        "const out = values.map((v) => encode(v).toString('hex'));\n"
        "const back = out.map((h) => decode(Buffer.from(h, 'hex')));\n"
        "const bin = decode(Buffer.from(process.argv[1], 'hex'));\n"
        "console.log(JSON.stringify({ out, back, bin: [bin.type, Buffer.isBuffer(bin.document), bin.document.toString()] }));\n"
    )
    framed_bin = msgpack.packb({"type": "exported", "document": b'{"a": 1}'}, use_bin_type=True).hex()
    done = subprocess.run([node(), "--input-type=module", "-e", script, framed_bin], cwd=NODE_DIR,
                          input=json.dumps(SAMPLES), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    for value, hexed in zip(SAMPLES, got["out"]):
        assert hexed == msgpack.packb(value, use_bin_type=True).hex(), value
    assert got["back"] == SAMPLES
    assert got["bin"] == ["exported", True, '{"a": 1}']
