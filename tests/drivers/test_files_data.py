"""The model-file copy's data path over real TLS and TCP on loopback (drivers/files.py,
file_data.py, file_sink.py): bytes over a plain TCP connection tied to the TLS session by a
one-time token, or inside TLS on request; a version 2 client still served; a copy
cancelled or SIGKILLed halfway resumes from what it kept; one file striped over two
addresses of a holder and over two holders. Every wait is bounded."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import trio

from p2pmesh.drivers import file_data
from p2pmesh.drivers.file_sink import read_sidecar, sidecar_path
from p2pmesh.drivers.files import MAGIC, CopyProgress, FileCopyError, Source, fetch_file, list_files, serve_files
from p2pmesh.drivers.streams import recv_exactly
from tests.drivers.test_files import HEADER, WEIGHTS, _model, _sha256
from tests.drivers.test_probe import Member

ROOT = Path(__file__).resolve().parents[2]


def _weights(tmp_path: Path, mib: int, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    with open(d / WEIGHTS, "wb") as f:
        for i in range(mib):
            f.write(hashlib.sha256(i.to_bytes(4, "big")).digest() * (1 << 15))  # 1 MiB, distinct per MiB
    return d


async def _serve(nursery: trio.Nursery, server: Member, model: Path, hosts: tuple[str, ...] = ("127.0.0.1",),
                 **kw: object) -> int:
    listeners = await trio.open_tcp_listeners(0, host=hosts[0])
    port = int(listeners[0].socket.getsockname()[1])
    for host in hosts[1:]:
        listeners += await trio.open_tcp_listeners(port, host=host)
    await nursery.start(lambda task_status: serve_files(listeners, server.server_ctx, lambda n: model,
                                                        task_status=task_status, **kw))
    return port


async def _raw_get(port: int, client: Member, request: list[str], version: int) -> trio.SSLStream[trio.SocketStream]:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, client.client_ctx, server_hostname="p2pmesh")
    await tls.do_handshake()
    body = msgpack.packb(request)
    await tls.send_all(HEADER.pack(MAGIC, version, len(body)) + body)
    return tls


@pytest.mark.trio
async def test_the_bytes_travel_outside_tls_the_token_opens_one_data_connection_and_version_2_is_served(tmp_path: Path) -> None:
    server, client = Member(), Member()
    model = _model(tmp_path)
    data = (model / WEIGHTS).read_bytes()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, model)
            tls = await _raw_get(port, client, ["get", "tiny", WEIGHTS, "tcp"], 3)
            head = await recv_exactly(tls, 1 + 8 + 32 + 1)
            assert head[0] == 0 and int.from_bytes(head[1:9], "big") == len(data)
            assert head[9:41] == hashlib.sha256(data).digest() and head[41] == 1  # the digest, then mode TCP
            token = await recv_exactly(tls, file_data.TOKEN_BYTES)
            wrong = await file_data.open_data("127.0.0.1", port, os.urandom(file_data.TOKEN_BYTES))
            assert await wrong.receive_some(16) == b""  # an unknown token: closed, nothing sent
            stream = await file_data.open_data("127.0.0.1", port, token)
            again = await file_data.open_data("127.0.0.1", port, token)
            assert await again.receive_some(16) == b""  # one time only
            await tls.send_all((1000).to_bytes(8, "big") + (5000).to_bytes(8, "big"))
            assert await recv_exactly(stream, 5000) == data[1000:6000]  # a range, in the clear
            await tls.send_all((len(data) - 10).to_bytes(8, "big") + (11).to_bytes(8, "big"))  # beyond the end
            try:  # the server ends the session
                assert await tls.receive_some(16) == b""
            except trio.BrokenResourceError:
                pass
            assert await stream.receive_some(16) == b""  # and its data connection, nothing more sent
            for s in (wrong, stream, again, tls):
                await trio.aclose_forcefully(s)
            # A version 2 client is still served: the whole file inside TLS, then its SHA-256.
            tls = await _raw_get(port, client, ["get", "tiny", WEIGHTS], 2)
            head = await recv_exactly(tls, 9)
            assert head[0] == 0 and int.from_bytes(head[1:], "big") == len(data)
            assert await recv_exactly(tls, len(data)) == data
            assert await recv_exactly(tls, 32) == hashlib.sha256(data).digest()
            await trio.aclose_forcefully(tls)
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_over_tls_on_request_and_from_a_server_that_keeps_its_files_confidential(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server, client = Member(), Member()
    model = _model(tmp_path)
    caplog.set_level(logging.INFO, logger="p2pmesh.files")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, model)
            got = await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", WEIGHTS,
                                   tmp_path / "a", over_tls=True)
            assert got[1] == _sha256(model / WEIGHTS) and (tmp_path / "a" / WEIGHTS).read_bytes() == (model / WEIGHTS).read_bytes()
            port2 = await _serve(nursery, server, model, tls_only=True)
            await fetch_file("127.0.0.1", port2, client.client_ctx, server.node_id, "tiny", WEIGHTS, tmp_path / "b")
            assert (tmp_path / "b" / WEIGHTS).read_bytes() == (model / WEIGHTS).read_bytes()
            nursery.cancel_scope.cancel()
    modes = re.findall(r"sent \d+ bytes of \S+ of tiny \((\w+)\)", caplog.text)
    assert modes == ["TLS", "TLS"]  # asked for TLS; asked for TCP of a TLS-only server


@pytest.mark.trio
async def test_a_copy_cancelled_halfway_resumes_from_what_it_kept(tmp_path: Path) -> None:
    server, client = Member(), Member()
    model = _weights(tmp_path, 48)
    dest = tmp_path / "copy"
    size = (model / WEIGHTS).stat().st_size
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, model)
            progress = CopyProgress()
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as inner:
                    inner.start_soon(lambda: fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny",
                                                        WEIGHTS, dest, progress=progress, piece_bytes=4 << 20,
                                                        checkpoint_bytes=1 << 20))
                    while progress.done < size // 2:
                        await trio.sleep(0.0005)
                    done_at_cancel = progress.done
                    inner.cancel_scope.cancel()
            assert not scope.cancelled_caught and done_at_cancel < size
            assert not (dest / WEIGHTS).exists()
            kept = sum(b - a for a, b in read_sidecar(dest / f"{WEIGHTS}.partial", size, _sha256(model / WEIGHTS)))
            assert kept >= 0.9 * done_at_cancel, (kept, done_at_cancel)
            again = CopyProgress()
            await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", WEIGHTS, dest, progress=again)
            assert again.kept == kept and again.done == size
            nursery.cancel_scope.cancel()
    assert (dest / WEIGHTS).read_bytes() == (model / WEIGHTS).read_bytes()
    assert not (dest / f"{WEIGHTS}.partial").exists() and not sidecar_path(dest / f"{WEIGHTS}.partial").exists()


CHILD = """
import sys, trio
from pathlib import Path
from p2pmesh.drivers import file_data
from p2pmesh.drivers.files import fetch_file
from tests.drivers.test_probe import Member
file_data.RECV_BYTES = 1 << 20  # written (and checkpointed) in 1 MiB steps
port, node, dest = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
trio.run(lambda: fetch_file("127.0.0.1", port, Member().client_ctx, node, "tiny", sys.argv[4], dest,
                            checkpoint_bytes=1 << 20))
"""


@pytest.mark.trio
async def test_a_copy_sigkilled_halfway_keeps_what_it_had_written(tmp_path: Path) -> None:
    """The client process is killed (SIGKILL) once half the file is on disk: the next copy
    keeps >= 90% of what the partial held and asks only for the rest."""
    server, client = Member(), Member()
    model = _weights(tmp_path, 64)
    dest = tmp_path / "copy"
    partial = dest / f"{WEIGHTS}.partial"
    size, digest = (model / WEIGHTS).stat().st_size, _sha256(model / WEIGHTS)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, model)
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            proc = await trio.lowlevel.open_process([sys.executable, "-c", CHILD, str(port), server.node_id, str(dest), WEIGHTS],
                                                    env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
            written = 0
            try:
                for _ in range(60_000):  # bounded: 0.5 ms steps, under the 90 s above
                    if partial.exists() and partial.stat().st_size >= size // 2:
                        break
                    assert proc.poll() is None, "the copy ended before half of it"
                    await trio.sleep(0.0005)
            finally:
                proc.send_signal(signal.SIGKILL)
                written = partial.stat().st_size if partial.exists() else 0
                await proc.wait()
            assert size // 2 <= written < size
            kept = sum(b - a for a, b in read_sidecar(partial, size, digest))
            assert kept >= 0.9 * written, (kept, written)
            again = CopyProgress()
            await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", WEIGHTS, dest, progress=again)
            assert again.kept == kept
            nursery.cancel_scope.cancel()
    assert (dest / WEIGHTS).read_bytes() == (model / WEIGHTS).read_bytes()


@pytest.mark.trio
async def test_one_file_striped_over_two_addresses_and_over_two_holders(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Pieces go to every source; a holder whose copy differs (another digest) drops out and
    the others finish the file, which is checked as a whole."""
    a, b, bad, client = Member(), Member(), Member(), Member()
    model = _weights(tmp_path, 24)
    other = _weights(tmp_path, 24, "other")
    with open(other / WEIGHTS, "r+b") as f:
        f.write(b"rot")
    size = (model / WEIGHTS).stat().st_size
    caplog.set_level(logging.INFO, logger="p2pmesh.files")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port_a = await _serve(nursery, a, model, ("127.0.0.2", "127.0.0.3"))
            port_b = await _serve(nursery, b, model)
            port_bad = await _serve(nursery, bad, other)
            await fetch_file("127.0.0.2", port_a, client.client_ctx, a.node_id, "tiny", WEIGHTS, tmp_path / "two",
                             also=[Source("127.0.0.3", port_a, a.node_id)], piece_bytes=1 << 20)
            two = [int(n) for n in re.findall(r"sent (\d+) bytes of", caplog.text)]
            assert len(two) == 2 and sum(two) == size and min(two) > 0, two
            caplog.clear()
            await fetch_file("127.0.0.1", port_b, client.client_ctx, b.node_id, "tiny", WEIGHTS, tmp_path / "holders",
                             also=[Source("127.0.0.2", port_a, a.node_id), Source("127.0.0.1", port_bad, bad.node_id)],
                             piece_bytes=1 << 20)
            sent = [int(n) for n in re.findall(r"sent (\d+) bytes of", caplog.text)]
            assert sum(sent) == size and len([n for n in sent if n > 0]) == 2, sent  # the bad holder sent nothing
            with pytest.raises(FileCopyError, match="corrupt"):  # alone, the bad holder's copy is refused
                await fetch_file("127.0.0.1", port_bad, client.client_ctx, bad.node_id, "tiny", WEIGHTS,
                                 tmp_path / "bad", digest_expected=_sha256(model / WEIGHTS))
            assert (await list_files("127.0.0.2", port_a, client.client_ctx, a.node_id, "tiny"))[WEIGHTS][0] == size
            nursery.cancel_scope.cancel()
    for d in ("two", "holders"):
        assert (tmp_path / d / WEIGHTS).read_bytes() == (model / WEIGHTS).read_bytes()
