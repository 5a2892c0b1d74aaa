"""The worker's stdin commands and limits (protocol.py, serve.read_line), sampling
(sampling.py), the pipeline header codec, and make_tiny_model's determinism."""
from __future__ import annotations

import io
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from p2pmesh.worker import protocol
from p2pmesh.worker.pipeline import OP_DECODE, OP_PREFILL, OP_RELEASE, Header, PipelineError, WireRow, decode_rows, encode_rows
from p2pmesh.worker.sampling import SamplingParams, sample, step_key_seed
from p2pmesh.worker.serve import LineTooLong, read_line
from tests.fixtures.tiny_model import make_tiny_model


def test_a_generate_command_is_parsed_with_defaults() -> None:
    cmd = protocol.parse_command(b'{"op": "generate", "id": "r1", "prompt": "hi"}')
    assert cmd == protocol.Generate("r1", "hi", None, protocol.DEFAULT_MAX_TOKENS, 0.0, 1.0, 0)
    cmd = protocol.parse_command('{"op": "generate", "id": "r2", "prompt": "ignored", "prompt_tokens": [1, 2], '
                                 '"max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 2147483647}')
    assert cmd == protocol.Generate("r2", None, (1, 2), 3, 0.5, 0.9, 2**31 - 1)
    assert protocol.parse_command('{"op": "shutdown"}') == protocol.Shutdown()
    assert protocol.parse_command('{"op": "cancel", "id": "r1"}') == protocol.Cancel("r1")


@pytest.mark.parametrize(
    ("line", "rid", "message"),
    [
        ('{"op": "generate", "prompt": "x"}', None, "needs an \"id\""),
        ('{"op": "generate", "id": "a"}', "a", "needs \"prompt\""),
        ('{"op": "generate", "id": "a", "prompt_tokens": [1, -2]}', "a", "non-negative"),
        ('{"op": "generate", "id": "a", "prompt_tokens": [1, true]}', "a", "non-negative"),
        ('{"op": "generate", "id": "a", "prompt": "x", "max_tokens": 100000}', "a", "max_tokens"),
        ('{"op": "generate", "id": "a", "prompt": "x", "temperature": -1}', "a", "temperature"),
        ('{"op": "generate", "id": "a", "prompt": "x", "seed": -1}', "a", "seed"),
        ('{"op": "generate", "id": "a", "prompt": "x", "seed": 1.5}', "a", "seed"),
        # The control protocol's seed limit (core/protocol.py), the same the agent checks.
        ('{"op": "generate", "id": "a", "prompt": "x", "seed": 2147483648}', "a", "seed"),
        ('{"op": "generate", "id": "a", "prompt": "x", "temperature": 10.5}', "a", "temperature"),
        ('{"op": "launch", "id": "a"}', "a", "unknown op"),
        ('{"op": "cancel"}', None, "cancel needs an \"id\""),
        ("[]", None, "not a JSON object"),
    ],
)
def test_bad_commands_say_what_is_wrong(line: str, rid: str | None, message: str) -> None:
    with pytest.raises(protocol.CommandError, match=message) as e:
        protocol.parse_command(line)
    assert e.value.request_id == rid


def test_prompt_limits() -> None:
    limits = protocol.Limits(max_prompt_tokens=3, max_tokens_cap=4)
    with pytest.raises(protocol.CommandError, match="more than 3"):
        protocol.parse_command('{"op": "generate", "id": "a", "prompt_tokens": [1, 2, 3, 4]}', limits)
    with pytest.raises(protocol.CommandError, match="1..4"):
        protocol.parse_command('{"op": "generate", "id": "a", "prompt": "x", "max_tokens": 5}', limits)


def test_an_overlong_line_is_skipped_whole() -> None:
    stream = io.BytesIO(b'{"op": "shutdown"}\n' + b"x" * 100 + b"\n" + b"short\n")
    assert read_line(stream, 50) == b'{"op": "shutdown"}'
    with pytest.raises(LineTooLong):
        read_line(stream, 50)
    assert read_line(stream, 50) == b"short"
    assert read_line(stream, 50) is None


def test_the_pipeline_header_and_rows_round_trip() -> None:
    h = Header(OP_DECODE, 3, 1, 3, 2)
    assert Header.decode(h.encode()) == h
    rows = [WireRow(5, 1234, 3, 0.7, 0.95, 2**64 - 5), WireRow(6, 0), WireRow(2**31 - 1, 7, 2, 10.0, 1.0, 1)]
    back = decode_rows(encode_rows(rows))
    assert [(r.no, r.position, r.flags, r.key_seed) for r in back] == [(r.no, r.position, r.flags, r.key_seed) for r in rows]
    assert [r.temperature for r in back] == [pytest.approx(r.temperature) for r in rows]
    assert [r.top_p for r in back] == [pytest.approx(r.top_p) for r in rows]
    with pytest.raises(PipelineError, match="out of sync"):
        Header.decode(mx.zeros((8,), dtype=mx.int32))
    for bad in (Header(OP_PREFILL, 2, 4), Header(OP_DECODE, 0, 1), Header(OP_RELEASE, 0), Header(9, 1, 1)):
        with pytest.raises(PipelineError, match="bad pipeline header"):
            Header.decode(bad.encode())


def test_sampling() -> None:
    logits = mx.array([0.0, 1.0, 3.0, 2.9, -1.0])
    assert int(sample(logits, 0.0, 1.0, 0).item()) == 2  # greedy
    draws = [int(sample(logits, 1.0, 1.0, step_key_seed(3, p)).item()) for p in range(200)]
    assert draws == [int(sample(logits, 1.0, 1.0, step_key_seed(3, p)).item()) for p in range(200)]  # reproducible
    assert set(draws) == {0, 1, 2, 3, 4} or len(set(draws)) >= 4  # temperature 1 visits the tail
    # top_p 0.5: only the two most likely tokens (0.47 and 0.43 of the mass) can come out.
    assert {int(sample(logits, 1.0, 0.5, step_key_seed(3, p)).item()) for p in range(200)} == {2, 3}
    assert step_key_seed(1, 2) != step_key_seed(2, 1) and 0 <= step_key_seed(2**64 - 1, 10**9) < 2**64
    with pytest.raises(ValueError):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_make_tiny_model_is_deterministic_and_loads_in_mlx_lm(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "qwen3", 3, 32, seed=5, shards=2)
    b = make_tiny_model(tmp_path / "b", "qwen3", 3, 32, seed=5, shards=2)
    c = make_tiny_model(tmp_path / "c", "qwen3", 3, 32, seed=6, shards=2)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= set(files)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "model-00001-of-00002.safetensors").read_bytes() != (c / "model-00001-of-00002.safetensors").read_bytes()
    model, tokenizer = mlx_lm.load(str(a))
    assert len(model.layers) == 3
    assert model.args.vocab_size == len(tokenizer.vocab) > 256
    ids = tokenizer.encode("Once upon a time")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "Once upon a time"
    assert model(mx.array([ids])).shape == (1, len(ids), model.args.vocab_size)


def test_measure_reports_sizes_from_the_headers_and_a_layer_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from p2pmesh.worker.measure import main

    path = make_tiny_model(tmp_path / "m", "llama", 4, 64, heads=4, kv_heads=2, intermediate=128)
    assert main(["--model", str(path), "--context", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    # q, o: 64x64; k, v: 32x64; gate, up, down: 128x64; two norms of 64; float32.
    assert out["layer_bytes"] == 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64 + 2 * 64)
    assert out["embed_bytes"] == 4 * vocab * 64 and out["head_bytes"] == 0  # tied
    assert out["kv_bytes_per_token_per_layer"] == 2 * 2 * 16 * 4 and out["activation_bytes"] == 64 * 4
    assert out["layers"] == 4 and out["layer_ms"] > 0 and out["memory_bytes"] > 0
    # Cut in half (2 KV heads do not split 4 ways): the share's time, and the fixed part
    # F = (share - whole / 2) / (1 - 1 / 2), kept within [0, whole].
    assert out["split_ranks"] == 2 and out["split_layer_ms"] > 0
    expected = min(out["layer_ms"], max(0.0, (out["split_layer_ms"] - out["layer_ms"] / 2) / 0.5))
    assert out["layer_fixed_ms"] == pytest.approx(expected, abs=2e-4)


def test_measure_of_a_layer_it_cannot_cut_reports_no_fixed_part(tmp_path: Path) -> None:
    """deepseek_v3's MLA attention has no q/k/v/o to cut (worker/tensor.py): the layer is
    timed whole and its fixed part is unknown, 0."""
    from p2pmesh.worker.measure import layer_times

    path = make_tiny_model(tmp_path / "m", "deepseek_v3", 3, 64, heads=4, kv_heads=4, intermediate=128)
    times = layer_times(path, 3, context=16)
    assert times.layer_ms > 0 and (times.fixed_ms, times.split_ranks, times.split_ms) == (0.0, 0, 0.0)


def test_measure_of_a_quantized_layer_times_it_whole(tmp_path: Path) -> None:
    """Quantized weights are not cut by rows here: the layer is timed whole, no fixed part,
    and the measurement still succeeds (it once failed, so the Mac never offered itself)."""
    from p2pmesh.worker.measure import layer_times
    from tests.agent.test_moe_loopback import LAYERS, _model

    path = _model(tmp_path, "qwen3_moe-4bit")  # mlx-lm's convert, 4-bit
    times = layer_times(path, LAYERS, context=16)
    assert times.layer_ms > 0 and (times.fixed_ms, times.split_ranks) == (0.0, 0)


def test_error_events_carry_a_known_code() -> None:
    assert protocol.error(protocol.REQUEST_INVALID, "too long", "r1") == {
        "event": "error", "id": "r1", "code": "request_invalid", "message": "too long"}
    assert protocol.error(protocol.PIPELINE_BROKEN, "peer lost") == {"event": "error", "code": "pipeline_broken", "message": "peer lost"}
    with pytest.raises(ValueError, match="unknown error code"):
        protocol.error("oops", "no such code")
