"""What a Mac shares of its disk (peer_copy.lookup): only the model the cluster committed,
only from a directory with a config.json; and where copies go (copy_dir)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from p2pmesh.core.messages import ModelInfo
from p2pmesh.peer_copy import copy_dir, has_layers, lookup


def _agent(tmp_path: Path, committed: str | None) -> SimpleNamespace:
    model = None if committed is None else ModelInfo(committed, 2, 1, 1, 1, 1, 1)
    machine = SimpleNamespace(raft=SimpleNamespace(state=SimpleNamespace(model=model)))
    config = SimpleNamespace(model_root=tmp_path / "root", state_dir=tmp_path / "state")
    return SimpleNamespace(machine=machine, config=config)


def test_only_the_committed_model_from_a_model_directory_is_shared(tmp_path: Path) -> None:
    (tmp_path / "root" / "tiny").mkdir(parents=True)
    (tmp_path / "root" / "tiny" / "config.json").write_text("{}")
    (tmp_path / "root" / "docs").mkdir()
    assert lookup(_agent(tmp_path, "tiny"), "tiny") == tmp_path / "root" / "tiny"  # type: ignore[arg-type]
    assert lookup(_agent(tmp_path, "tiny"), str(tmp_path / "root" / "docs")) is None  # type: ignore[arg-type]  # not committed
    assert lookup(_agent(tmp_path, None), "tiny") is None  # type: ignore[arg-type]
    assert lookup(_agent(tmp_path, "docs"), "docs") is None  # type: ignore[arg-type]  # committed, but no config.json
    mine = copy_dir(tmp_path / "state", "org/other")
    mine.mkdir(parents=True)
    (mine / "config.json").write_text("{}")
    assert lookup(_agent(tmp_path, "org/other"), "org/other") == mine  # type: ignore[arg-type]  # a copy is shared on


def test_copies_of_two_names_never_share_a_directory(tmp_path: Path) -> None:
    a, b = copy_dir(tmp_path, "/Users/me/models/llama"), copy_dir(tmp_path, "/Users/you/models/llama")
    assert a != b and a.parent == b.parent == tmp_path / "models"
    assert "/" not in a.name and a.name.startswith("Users-me-models-llama-")
    assert not has_layers(tmp_path / "missing", (0, 1))


def test_copies_of_other_models_are_pruned_and_nothing_else_is_touched(tmp_path: Path) -> None:
    from p2pmesh.peer_copy import prune_copies

    keep, other = copy_dir(tmp_path, "tiny"), copy_dir(tmp_path, "org/old")
    for d in (keep, other):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "models" / "link").symlink_to(outside)  # never followed, never removed
    assert prune_copies(tmp_path, "tiny") == [other]
    assert keep.is_dir() and not other.exists() and outside.is_dir() and (tmp_path / "models" / "link").is_symlink()
    assert prune_copies(tmp_path / "nothing-here", "tiny") == []


def test_the_http_api_finds_the_tokenizer_of_a_model_this_mac_only_copied(tmp_path: Path) -> None:
    """A Mac serving a model it copied from another Mac has no directory of its own for it:
    chat templates and token counts must come from its copy."""
    import shutil

    from p2pmesh.http_api import Tokenizers
    from tests.agent.harness import ROOT

    mine = copy_dir(tmp_path / "state", "p2pmesh-demo-model")
    mine.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ROOT / "scripts" / "demo_model" / f, mine / f)
    assert Tokenizers(tmp_path / "root", tmp_path / "state")._load("p2pmesh-demo-model").tokenizer is not None
    assert Tokenizers(tmp_path / "root")._load("p2pmesh-demo-model").tokenizer is None  # no copy dir known: none


def test_the_client_finds_the_chat_template_in_the_agents_copy(tmp_path: Path) -> None:
    import shutil

    from p2pmesh.client import P2PMeshError, _model_directory
    from tests.agent.harness import ROOT

    with pytest.raises(P2PMeshError, match="no such directory"):
        _model_directory("p2pmesh-demo-model", None, tmp_path / "state")
    mine = copy_dir(tmp_path / "state", "p2pmesh-demo-model")
    mine.mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo_model" / "config.json", mine / "config.json")
    assert _model_directory("p2pmesh-demo-model", None, tmp_path / "state") == mine
