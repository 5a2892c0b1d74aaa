"""Only the files a Mac needs come from Hugging Face (p2pmesh/drivers/model_files.py): naming a
model fetches its metadata, measuring fetches the file holding the timed layer, and a stage
fetches the files holding its layers, while every Mac still describes the whole model from
the safetensors headers.

Nothing can be downloaded here, so the hub is a stand-in: huggingface_hub's two calls the
code makes (snapshot_download with allow_patterns, get_safetensors_metadata) are replaced
by ones that serve a tiny sharded checkpoint from a local directory, filtered by the same
allow_patterns semantics (fnmatch) and returning huggingface_hub's own metadata classes. What
is tested is which files p2pmesh asks for and what it does with them; the HTTP side is
huggingface_hub's."""
from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest

from p2pmesh.agent import models
from p2pmesh.drivers import model_files
from p2pmesh.worker import measure
from p2pmesh.worker.checkpoint import read_header
from p2pmesh.worker.model import load_shard, resolve_model
from tests.agent.harness import make_model

REPO = "tiny-org/tiny-llama"
LAYERS = 6


class FakeHub:
    def __init__(self, repo: Path, cache: Path) -> None:
        self.repo, self.cache = repo, cache
        self.fetched: list[str] = []
        """Every weight file copied into the local snapshot, in order (repeats included)."""

    def snapshot_download(self, repo_id: str, *, revision: str | None = None, allow_patterns: list[str] | None = None,
                          **_: object) -> str:
        assert repo_id == REPO and revision is None
        local = self.cache / repo_id.replace("/", "--")
        local.mkdir(parents=True, exist_ok=True)
        for f in sorted(self.repo.iterdir()):
            if allow_patterns is not None and not any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                continue
            if not (local / f.name).exists():
                shutil.copy2(f, local / f.name)
                if f.suffix == ".safetensors":
                    self.fetched.append(f.name)
        return str(local)

    def hf_hub_download(self, repo_id: str, filename: str, *, revision: str | None = None, dry_run: bool = False,
                        tqdm_class: type | None = None, **_: object) -> object:
        """One file (p2pmesh/agent/tasks/hub_share.py downloads a stage file by file), its
        bytes counted through ``tqdm_class`` as huggingface_hub does; a dry run says its size."""
        from huggingface_hub.file_download import DryRunFileInfo

        assert repo_id == REPO and revision is None
        src = self.repo / filename
        if dry_run:
            return DryRunFileInfo(commit_hash="0" * 40, file_size=src.stat().st_size, filename=filename, local_path=str(self.cache / filename), is_cached=False, will_download=True)
        local = self.cache / repo_id.replace("/", "--")
        local.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, local / filename)
        if tqdm_class is not None:
            bar = tqdm_class(total=src.stat().st_size)
            bar.update(src.stat().st_size)
            bar.close()
        self.fetched.append(filename)
        return str(local / filename)

    def get_safetensors_metadata(self, repo_id: str, *, revision: str | None = None, **_: object) -> object:
        from huggingface_hub.utils._safetensors import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

        assert repo_id == REPO
        files = {}
        weight_map = {}
        for f in sorted(self.repo.glob("*.safetensors")):
            _, entries = read_header(f)
            files[f.name] = SafetensorsFileMetadata({}, {e.name: TensorInfo(e.dtype, list(e.shape), (e.begin, e.begin + e.nbytes))
                                                          for e in entries})
            weight_map.update((e.name, f.name) for e in entries)
        return SafetensorsRepoMetadata(None, True, weight_map, files)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("hub") / "tiny-llama", family="llama", layers=LAYERS, hidden=64, shards=3)


@pytest.fixture
def hub(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    import huggingface_hub

    fake = FakeHub(repo, tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", fake.get_safetensors_metadata)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    return fake


def _weight_map(repo: Path) -> dict[str, str]:
    wm = model_files.weight_map(repo)
    assert wm is not None and len(set(wm.values())) == 3  # the fixture really is sharded
    return wm


def test_naming_a_hub_model_fetches_no_weights_and_describes_it_whole(hub: FakeHub, repo: Path) -> None:
    path = models.resolve(REPO)
    assert (path / "config.json").is_file() and (path / model_files.INDEX_FILE).is_file()
    assert hub.fetched == []
    assert models.describe(REPO, path, 256) == models.describe(REPO, repo, 256)  # the hub's headers, the same sums


def test_measuring_fetches_only_the_file_of_the_timed_layer(hub: FakeHub, repo: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    wm = _weight_map(repo)
    config = json.loads((repo / "config.json").read_text())
    timed = model_files.measured_layer(LAYERS)
    expected = model_files.files_for_layers(config, wm, timed, timed + 1)
    assert measure.main(["--model", REPO, "--context", "16"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(hub.fetched) == expected and len(expected) < len(set(wm.values()))
    assert result["layer_ms"] > 0 and result["layers"] == LAYERS
    timings = ("layer_ms", "layer_fixed_ms", "split_ranks", "split_layer_ms", "memory_bytes")
    assert result == {**measure.model_sizes(str(repo), repo), **{k: result[k] for k in timings}}  # whole-model sizes, from the hub's headers
    assert 0 <= result["layer_fixed_ms"] <= result["layer_ms"]


@pytest.mark.parametrize("stage", [(0, 2), (2, 4), (4, LAYERS)])
def test_a_stage_fetches_only_the_files_holding_its_layers_and_loads_from_them(
        hub: FakeHub, repo: Path, stage: tuple[int, int]) -> None:
    config = json.loads((repo / "config.json").read_text())
    expected = model_files.files_for_layers(config, _weight_map(repo), *stage)
    path = resolve_model(REPO, layers=stage)
    assert sorted(hub.fetched) == expected
    shard = load_shard(path, *stage)
    whole = load_shard(repo, *stage)
    assert shard.loaded == whole.loaded and shard.loaded_bytes == whole.loaded_bytes


def test_a_malformed_index_from_the_hub_is_a_clear_error(hub: FakeHub, repo: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad)
    index = json.loads((bad / model_files.INDEX_FILE).read_text())
    index["weight_map"]["model.embed_tokens.weight"] = "../../etc/passwd"
    (bad / model_files.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(model_files.ModelFilesError, match="not a safetensors file beside it"):
        model_files.weight_map(bad)


def test_the_agent_fetches_a_stage_no_other_mac_has_from_the_hub(hub: FakeHub, repo: Path, tmp_path: Path) -> None:
    """p2pmesh/agent/tasks/fetch.ensure_layers, as before a worker starts: no member to copy from, so
    only the stage's files come from the hub, shown in the Mac's copy directory; a local
    directory needs nothing fetched; a name that is neither is a clear error."""
    import ssl

    import trio

    from p2pmesh.agent.ports import ViewPublisher
    from p2pmesh.agent.tasks.fetch import ensure_layers
    from p2pmesh.agent.tasks.peer_copy import ModelPlaces, PeerCopy
    from p2pmesh.core.ids import NodeId

    # Not in a cluster yet: no member to copy from.
    agent = PeerCopy(ViewPublisher(NodeId("me")).view, ModelPlaces(tmp_path / "state"), ssl.create_default_context())
    config = json.loads((repo / "config.json").read_text())
    path = trio.run(ensure_layers, agent, REPO, (4, LAYERS))
    assert sorted(hub.fetched) == model_files.files_for_layers(config, _weight_map(repo), 4, LAYERS)
    assert path == tmp_path / "state" / "models" / path.name and all((path / f).is_file() for f in hub.fetched)
    assert trio.run(ensure_layers, agent, str(repo), (0, 2)) == repo
    assert sorted(hub.fetched) == model_files.files_for_layers(config, _weight_map(repo), 4, LAYERS)  # nothing more
    with pytest.raises(models.ModelError, match="no other Mac has it"):
        trio.run(ensure_layers, agent, "./nowhere", (0, 2))


def test_a_hub_download_is_linked_into_the_copy_directory(hub: FakeHub, repo: Path, tmp_path: Path) -> None:
    """What a Mac fetched from the hub is shown in its copy directory (symlinks), so it loads
    from, and serves to the other Macs, one directory whatever each file came from."""
    from p2pmesh.agent.models import copy_dir, has_layers, link_snapshot

    snapshot = model_files.fetch_layers(REPO, (0, 2))
    dest = copy_dir(tmp_path / "state", REPO)
    link_snapshot(snapshot, dest)
    link_snapshot(snapshot, dest)  # again: nothing changes, nothing fails
    config = json.loads((repo / "config.json").read_text())
    last = set(model_files.files_for_layers(config, _weight_map(repo), 4, LAYERS))
    assert has_layers(dest, (0, 2)) and has_layers(dest, (4, LAYERS)) == last.issubset(hub.fetched)
    assert all((dest / f).resolve() == (snapshot / f).resolve() for f in hub.fetched)
    assert load_shard(dest, 0, 2).loaded == load_shard(repo, 0, 2).loaded
