"""The model-file driver over real TLS on loopback: listing and copying a model's files,
node-id binding, outsiders refused, only model file names served (never another path),
the session limit, and a copy that breaks off leaves no file behind. Every wait is bounded."""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import msgpack
import pytest
import trio

from p2pmesh.drivers.files import (
    MAGIC,
    MANIFEST,
    SESSIONS_MAX,
    VERSION,
    FileCopyError,
    fetch_file,
    list_files,
    read_manifest,
    serve_files,
    servable,
    write_manifest,
)
from p2pmesh.drivers.streams import recv_exactly
from tests.drivers.test_probe import OTHER_KEY, Member

HEADER = struct.Struct(">4sBH")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model-00001-of-00001.safetensors").write_bytes(os.urandom(3 << 20))
    (d / "notes.txt").write_text("private")  # lies beside the model: never served
    (d / ".hidden.json").write_text("{}")
    return d


async def _serve(nursery: trio.Nursery, server: Member, lookup) -> int:  # type: ignore[no-untyped-def]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(serve_files, listeners, server.server_ctx, lookup)
    return int(listeners[0].socket.getsockname()[1])


def test_names_served_are_model_files_only() -> None:
    assert servable("config.json") and servable("model-00001-of-00002.safetensors") and servable("tokenizer.json")
    for bad in ("../config.json", "a/config.json", ".config.json", "notes.txt", "id_rsa", "", "x" * 300 + ".safetensors"):
        assert not servable(bad), bad


@pytest.mark.trio
async def test_a_member_lists_and_copies_a_model(tmp_path: Path) -> None:
    server, client = Member(), Member()
    model = _model(tmp_path)
    dest = tmp_path / "copy"
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model if name == "tiny" else None)
            files = await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "tiny")
            assert set(files) == {"config.json", "model-00001-of-00001.safetensors"}  # not notes.txt, not hidden
            for name, (size, digest) in files.items():
                assert digest is None  # never sent yet: the server knows no digest
                assert await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", name, dest,
                                        size_expected=size) == (size, _sha256(model / name))
                assert (dest / name).read_bytes() == (model / name).read_bytes()
            with pytest.raises(FileCopyError, match="missing"):
                await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "other")
            with pytest.raises(FileCopyError, match="missing"):
                await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", "tokenizer.json", dest)
            with pytest.raises(ValueError):
                await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", "notes.txt", dest)
            nursery.cancel_scope.cancel()
    assert not list(dest.glob("*.partial"))


WEIGHTS = "model-00001-of-00001.safetensors"


@pytest.mark.trio
async def test_a_file_that_rotted_after_it_was_first_sent_is_refused(tmp_path: Path) -> None:
    """The first send teaches the server the file's digest; the same path, size and
    modification time with other bytes (bit rot) is then refused by the next Mac."""
    server, client = Member(), Member()
    model = _model(tmp_path)
    weights = model / WEIGHTS
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model)
            await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", WEIGHTS, tmp_path / "a")
            size, digest = (await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "tiny"))[WEIGHTS]
            assert digest == _sha256(weights)
            st = weights.stat()
            with open(weights, "r+b") as f:  # one flipped bit, as a failing disk would
                f.seek(12345)
                byte = f.read(1)
                f.seek(12345)
                f.write(bytes([byte[0] ^ 0x10]))
            os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
            with pytest.raises(FileCopyError, match="corrupt.*damaged"):
                await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", WEIGHTS, tmp_path / "b",
                                 size_expected=size, digest_expected=digest)
            nursery.cancel_scope.cancel()
    assert not (tmp_path / "b" / WEIGHTS).exists() and not list((tmp_path / "b").glob("*.partial"))


@pytest.mark.trio
async def test_a_copy_lists_the_digests_it_was_verified_against(tmp_path: Path) -> None:
    """A copy directory's manifest is what it lists; an entry for another size is ignored,
    and a manifest that disagrees with the file makes the next copy refuse it."""
    server, client = Member(), Member()
    model = _model(tmp_path)
    good = _sha256(model / "config.json")
    write_manifest(model, {"config.json": ((model / "config.json").stat().st_size, good),
                           WEIGHTS: ((model / WEIGHTS).stat().st_size, "0" * 64)})
    assert read_manifest(model)["config.json"][1] == good
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model)
            files = await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "tiny")
            assert MANIFEST not in files  # hidden: never served
            assert files["config.json"][1] == good and files[WEIGHTS][1] == "0" * 64
            assert (await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", "config.json",
                                     tmp_path / "c", digest_expected=good))[1] == good
            with pytest.raises(FileCopyError, match="corrupt"):
                await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", WEIGHTS, tmp_path / "c",
                                 digest_expected=files[WEIGHTS][1])
            nursery.cancel_scope.cancel()
    (model / MANIFEST).write_text("{not json")
    assert read_manifest(model) == {}


@pytest.mark.trio
async def test_a_hub_cache_file_is_listed_with_the_hubs_digest_and_checked_against_it(tmp_path: Path) -> None:
    """Hugging Face keeps a weight file as blobs/<SHA-256> linked from the snapshot: that
    name is the reference, so a blob damaged since the download is refused at once."""
    server, client = Member(), Member()
    data = os.urandom(1 << 20)
    digest = hashlib.sha256(data).hexdigest()
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / digest).write_bytes(data)
    (blobs / ("a" * 40)).write_text('{"model_type": "llama"}')  # a small file: named by its git hash
    (snapshot / WEIGHTS).symlink_to(blobs / digest)
    (snapshot / "config.json").symlink_to(blobs / ("a" * 40))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: snapshot)
            files = await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "tiny")
            assert files[WEIGHTS] == (len(data), digest) and files["config.json"][1] is None
            with open(blobs / digest, "r+b") as f:
                f.write(bytes([data[0] ^ 0xFF]))  # damaged on disk since the download
            with pytest.raises(FileCopyError, match="corrupt"):
                await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny", WEIGHTS, tmp_path / "d",
                                 digest_expected=files[WEIGHTS][1])
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_raw_request_for_another_path_gets_nothing(tmp_path: Path) -> None:
    """The name check is the server's, not only the client's."""
    server, client = Member(), Member()
    model = _model(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model)
            for name in ("notes.txt", "../model/notes.txt", "/etc/passwd"):
                tcp = await trio.open_tcp_stream("127.0.0.1", port)
                tls = trio.SSLStream(tcp, client.client_ctx, server_hostname="p2pmesh")
                await tls.do_handshake()
                body = msgpack.packb(["get", "tiny", name])
                await tls.send_all(HEADER.pack(MAGIC, VERSION, len(body)) + body)
                assert await tls.receive_some(16) == b"\x01"  # MISSING, and nothing else
                await trio.aclose_forcefully(tls)
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_outsiders_and_impostors_are_refused(tmp_path: Path) -> None:
    server, client, outsider, third = Member(), Member(), Member(OTHER_KEY), Member()
    model = _model(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model)
            with pytest.raises(FileCopyError, match="refused|protocol"):
                await list_files("127.0.0.1", port, outsider.client_ctx, server.node_id, "tiny")
            with pytest.raises(FileCopyError, match="wrong_node"):
                await list_files("127.0.0.1", port, client.client_ctx, third.node_id, "tiny")
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_copy_that_breaks_off_leaves_no_file(tmp_path: Path) -> None:
    """The server says a size, then the connection ends early: the client keeps nothing."""
    server, client = Member(), Member()
    model = _model(tmp_path)
    dest = tmp_path / "copy"
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model)
            with pytest.raises(FileCopyError, match="protocol"):
                await fetch_file("127.0.0.1", port, client.client_ctx, server.node_id, "tiny",
                                 "model-00001-of-00001.safetensors", dest, size_expected=5)  # listed size differs
            nursery.cancel_scope.cancel()
    assert not dest.exists() or not any(dest.iterdir())


@pytest.mark.trio
async def test_sessions_beyond_the_limit_are_told_busy(tmp_path: Path) -> None:
    server, client = Member(), Member()
    model = _model(tmp_path)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model)
            held = []
            for _ in range(SESSIONS_MAX):  # handshaken sessions that never send their request
                tcp = await trio.open_tcp_stream("127.0.0.1", port)
                tls = trio.SSLStream(tcp, client.client_ctx, server_hostname="p2pmesh")
                await tls.do_handshake()
                held.append(tls)
            await trio.sleep(0.2)
            with pytest.raises(FileCopyError, match="busy"):
                await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "tiny")
            for tls in held:
                await trio.aclose_forcefully(tls)
            await trio.sleep(0.2)
            assert "config.json" in await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "tiny")
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_garbage_requests_end_their_session_and_the_server_keeps_serving(tmp_path: Path) -> None:
    server, client = Member(), Member()
    model = _model(tmp_path)
    bodies = [b"", b"\x00" * 7, HEADER.pack(b"XXXX", VERSION, 0),
              HEADER.pack(MAGIC, VERSION, 60000), HEADER.pack(MAGIC, VERSION, 3) + b"\xc1\xc1\xc1",
              HEADER.pack(MAGIC, VERSION, 3) + msgpack.packb([1, 2]),
              HEADER.pack(MAGIC, VERSION, len(msgpack.packb(["put", "x"]))) + msgpack.packb(["put", "x"])]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, server, lambda name: model)
            for body in bodies:
                tcp = await trio.open_tcp_stream("127.0.0.1", port)
                tls = trio.SSLStream(tcp, client.client_ctx, server_hostname="p2pmesh")
                await tls.do_handshake()
                await tls.send_all(body)
                if len(body) < HEADER.size:
                    await trio.aclose_forcefully(tls)  # a client that gives up midway
                    continue
                with trio.fail_after(5):  # the server must end the session, not leave it hanging
                    try:
                        assert await tls.receive_some(16) == b""  # closed, nothing served
                    except trio.BrokenResourceError:
                        pass
                await trio.aclose_forcefully(tls)
            # An unknown version is refused clearly: status 3, then the highest version spoken.
            tcp = await trio.open_tcp_stream("127.0.0.1", port)
            tls = trio.SSLStream(tcp, client.client_ctx, server_hostname="p2pmesh")
            await tls.do_handshake()
            await tls.send_all(HEADER.pack(MAGIC, 9, 0))
            with trio.fail_after(5):
                assert await recv_exactly(tls, 2) == bytes([3, VERSION])
            await trio.aclose_forcefully(tls)
            assert "config.json" in await list_files("127.0.0.1", port, client.client_ctx, server.node_id, "tiny")
            nursery.cancel_scope.cancel()
