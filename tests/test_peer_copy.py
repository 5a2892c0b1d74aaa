"""What a Mac shares of its disk (peer_copy.lookup): only the model the cluster committed,
only from a directory with a config.json; and where copies go (models.copy_dir)."""
from __future__ import annotations

from pathlib import Path

import pytest

from p2pmesh.agent.models import copy_dir, has_layers
from p2pmesh.agent.ports import Snapshot, ViewPublisher
from p2pmesh.agent.tasks.peer_copy import ModelPlaces, lookup
from p2pmesh.core.ids import ClusterId, NodeId
from p2pmesh.core.messages import ClusterState, ModelInfo


def _lookup(tmp_path: Path, committed: str | None, name: str) -> Path | None:
    """lookup() with a view whose committed state names ``committed`` as the model."""
    model = None if committed is None else ModelInfo(committed, 2, 1, 1, 1, 1, 1)
    publisher = ViewPublisher(NodeId("me"))
    publisher.publish(Snapshot(0, NodeId("me"), None, ClusterState(ClusterId("c1"), (), 0, (), (), model=model)))
    return lookup(publisher.view, ModelPlaces(tmp_path / "state", tmp_path / "root"), name)


def test_only_the_committed_model_from_a_model_directory_is_shared(tmp_path: Path) -> None:
    (tmp_path / "root" / "tiny").mkdir(parents=True)
    (tmp_path / "root" / "tiny" / "config.json").write_text("{}")
    (tmp_path / "root" / "docs").mkdir()
    assert _lookup(tmp_path, "tiny", "tiny") == tmp_path / "root" / "tiny"
    assert _lookup(tmp_path, "tiny", str(tmp_path / "root" / "docs")) is None  # not committed
    assert _lookup(tmp_path, None, "tiny") is None
    assert _lookup(tmp_path, "docs", "docs") is None  # committed, but no config.json
    mine = copy_dir(tmp_path / "state", "org/other")
    mine.mkdir(parents=True)
    (mine / "config.json").write_text("{}")
    assert _lookup(tmp_path, "org/other", "org/other") == mine  # a copy is shared on


def test_copies_of_two_names_never_share_a_directory(tmp_path: Path) -> None:
    a, b = copy_dir(tmp_path, "/Users/me/models/llama"), copy_dir(tmp_path, "/Users/you/models/llama")
    assert a != b and a.parent == b.parent == tmp_path / "models"
    assert "/" not in a.name and a.name.startswith("Users-me-models-llama-")
    assert not has_layers(tmp_path / "missing", (0, 1))


def test_copies_of_other_models_are_pruned_and_nothing_else_is_touched(tmp_path: Path) -> None:
    from p2pmesh.agent.models import prune_copies

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

    from p2pmesh.agent.http import Tokenizers
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
