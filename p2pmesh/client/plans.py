"""The client's operations as sans-I/O plans (client/steps.py has the steps and the
socket-level plans): status (typed, or the agent's JSON object), waiting for a working
cluster, the model op and loading a model with its progress, the checks before a
generation, a chat prompt, watch, leave and pairing's conversation. AsyncClient and Client
run these very generators, so their behaviour is one.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pmesh.client.chat import chat_prompt, check_messages
from p2pmesh.client.events import diff
from p2pmesh.client.steps import REQUEST_TIMEOUT_S, Blocking, Clock, Emit, Plan, Sleep, ask, ask_answer, events
from p2pmesh.client.values import LoadedModel, LoadProgress, ModelInfo, Placement, Status, Transfer, formed, newest_epoch
from p2pmesh.client.values import parse_model, parse_status
from p2pmesh.core import protocol
from p2pmesh.core.protocol import AgentError, BadRequest, ModelNotLoaded, NoQuorum, refused

QUORUM_TIMEOUT_S = 30.0
"""How long an operation that needs a working cluster waits for one. A fresh agent founds
or joins a cluster within a second or two; a cut-off minority goes standalone after 3 s."""
LOAD_TIMEOUT_S = 600.0
POLL_S = 0.2
MODEL_TIMEOUT_S = 600.0
"""How long set_model waits for the agent's answer: it may first download the model."""
PROGRESS_EVERY_S = 1.0
"""While only the bytes fetched move, `load` reports its progress at most this often."""
MODEL_RESEND_S = 5.0
"""A model proposal can be lost when leadership moves before it commits; send it again if
the cluster has not committed it after this long (the model op is idempotent)."""
DEFAULT_CONTEXT_TOKENS = protocol.CONTEXT_TOKENS_DEFAULT


def status_object(timeout_s: float = REQUEST_TIMEOUT_S) -> Plan[dict[str, Any]]:
    """The agent's status JSON object as it sent it (what `p2pmesh status --json` prints)."""
    answer = yield from ask_answer({"op": "status"}, timeout_s)
    st = answer.get("status")
    if not isinstance(st, dict):
        raise AgentError("the agent's answer has no status object")
    return st


def status() -> Plan[Status]:
    return parse_status((yield from status_object()))


def healthy(timeout_s: float) -> Plan[Status]:
    """The status, once the agent hears a working leader; NoQuorum after timeout_s."""
    start = yield Clock()
    while True:
        st = yield from status()
        if st.healthy and formed(st):
            return st
        now = yield Clock()
        if now - start >= timeout_s:
            up = sum(1 for m in st.members if m.up)
            raise NoQuorum(
                f"the agent has no working cluster after {timeout_s:g} s (role {st.role}, {len(st.members)} members, "
                f"{up} up, leader {st.leader or 'none'}): a majority of the voters must reach each other. A Mac cut off "
                "from its cluster continues on its own after a few seconds; check `p2pmesh status` and the cables, then retry"
            )
        yield Sleep(POLL_S)


def _model_request(name: str | None, context_tokens: int, batch: int | None = None,
                   parallelism: str = "auto", kv_bits: int | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"op": "model", "name": name, "context_tokens": context_tokens}
    if batch is not None:  # else the agent's own --max-batch
        request["batch"] = batch
    if parallelism != "auto":  # the agent checks it (bad_request, param "parallelism")
        request["parallelism"] = parallelism
    if kv_bits is not None:  # else full precision; the agent checks it (bad_request, param "kv_bits")
        request["kv_bits"] = kv_bits
    return request


def _accepted(answer: dict[str, Any]) -> ModelInfo | None:
    model = answer.get("model")
    return None if model is None else parse_model(model)


def set_model(model: str | os.PathLike[str] | None, context_tokens: int, timeout_s: float,
              batch: int | None = None, parallelism: str = "auto", kv_bits: int | None = None) -> Plan[ModelInfo | None]:
    """The model op, once: the cluster is asked to serve `model` (None: no model). Returns
    once the agent proposed the choice, before it commits (the agent may first download the
    model: it allows that hours)."""
    name = None if model is None else model_name(model)
    answer = yield from ask_answer(_model_request(name, context_tokens, batch, parallelism, kv_bits), timeout_s)
    info = _accepted(answer)
    if name is not None and info is None:
        raise AgentError("the agent accepted the model but did not describe it")
    return info


def model_set(name: str, context_tokens: int, deadline: float, batch: int | None = None,
              parallelism: str = "auto", kv_bits: int | None = None) -> Plan[ModelInfo]:
    """`set_model` for `load`: a connection that closes unanswered (the agent restarted) is
    retried until the deadline; a finished download is in the cache for the next try."""
    while True:
        now = yield Clock()
        answer = yield from ask(_model_request(name, context_tokens, batch, parallelism, kv_bits), max(1.0, deadline - now),
                                eof_ok=True)
        if answer is not None:
            info = _accepted(answer)
            if info is None:
                raise AgentError("the agent accepted the model but did not describe it")
            return info
        now = yield Clock()
        if now >= deadline:
            raise ModelNotLoaded(f"the agent did not accept {name} in time (it was still resolving or downloading it)")
        yield Sleep(POLL_S)


def load_progress(name: str, p: Placement | None, floor: int, same: bool,
                  transfers: tuple[Transfer, ...] = ()) -> LoadProgress:
    """Where loading `name` stands. Epochs at or below `floor` were planned before our
    request (for another model), unless the model was already this one (`same`); while
    stages fetch their files, `transfers` (status's) say how far each Mac is."""
    if p is None or p.model != name:
        return LoadProgress(name, "accepted", detail="waiting for the cluster to commit the model")
    if p.pending is not None and (same or p.pending.epoch > floor):
        n, r, f = len(p.pending.stages), p.pending.ready_count, p.pending.fetched_count
        if f < n:
            return LoadProgress(name, "loading", r, n, p.pending.epoch,
                                f"epoch {p.pending.epoch}: {f} of {n} stages have their model files ({fetching(transfers)})",
                                transfers)
        return LoadProgress(name, "loading", r, n, p.pending.epoch, f"epoch {p.pending.epoch}: {r} of {n} stage workers loaded")
    if p.serving and p.stages and p.pending is None and (same or p.epoch > floor):
        n = len(p.stages)
        return LoadProgress(name, "serving", n, n, p.epoch, f"serving on {n} stage{'s' if n != 1 else ''} (epoch {p.epoch})")
    return LoadProgress(name, "planning", detail="members are measuring the model; the leader plans a placement")


def fetching(transfers: tuple[Transfer, ...]) -> str:
    """The fetch of every Mac together: MB done of MB in all, MB/s, the last Mac's time left."""
    if not transfers:
        return "fetching"
    done, total = sum(t.bytes_done for t in transfers), sum(t.bytes_total for t in transfers)
    going = [t.eta_s for t in transfers if t.bytes_done < t.bytes_total]
    etas = [e for e in going if e is not None]
    left = "" if not going else f", {max(etas):.0f} s left" if len(etas) == len(going) else ", time left unknown"
    return f"fetching {done / 1e6:.1f} of {total / 1e6:.1f} MB, {sum(t.mb_s for t in transfers):g} MB/s{left}"


def load(model: str | os.PathLike[str], context_tokens: int, timeout_s: float, quorum_timeout_s: float,
            on_progress: Callable[[LoadProgress], None] | None, batch: int | None = None,
            parallelism: str = "auto", kv_bits: int | None = None) -> Plan[LoadedModel]:
    name = model_name(model)
    kv_bits = kv_bits or None  # 0 is full precision too, as status says it (null)
    start = yield Clock()
    deadline = start + timeout_s
    before = yield from healthy(min(timeout_s, quorum_timeout_s))
    # Already serving this model as asked: done at once (asked another way: a new epoch).
    same = (before.placement is not None and before.placement.model == name
            and before.placement.parallelism_asked == parallelism and before.placement.kv_bits == kv_bits)
    floor = newest_epoch(before.placement)
    stale = before.placement.problem if before.placement is not None else None
    info = yield from model_set(name, context_tokens, deadline, batch, parallelism, kv_bits)
    sent = yield Clock()
    # Always report acceptance first: the next poll often finds the model committed already.
    last = load_progress(name, None, floor, same)
    told = sent
    if on_progress is not None:
        on_progress(last)
    while True:
        st = yield from status()
        problem = st.placement.problem if st.placement is not None else None
        if problem is not None and problem.model == name and problem.context_tokens == context_tokens:
            now = yield Clock()
            # A verdict seen before our request stands once the cluster had time to take the
            # request (a model set again is measured again where it could not be loaded).
            if problem != stale or now - sent >= MODEL_RESEND_S:
                raise refused(problem)
        else:
            stale = None
        progress = load_progress(name, st.placement, floor, same, st.transfers)
        stepped = (progress.stage, progress.ready, progress.stages, progress.epoch) != (last.stage, last.ready, last.stages,
                                                                                         last.epoch)
        if progress != last:
            now = yield Clock()
            # Bytes alone are told at most once a PROGRESS_EVERY_S (a pipe gets a line a second, not five).
            if stepped or now - told >= PROGRESS_EVERY_S:
                last, told = progress, now
                if on_progress is not None:
                    on_progress(progress)
        if progress.done:
            assert st.placement is not None
            return LoadedModel(info.name, info.layers, info.layer_bytes, info.context_tokens, st.placement)
        now = yield Clock()
        if now >= deadline:
            raise ModelNotLoaded(f"{name} is not serving after {timeout_s:g} s: {progress.stage}, {progress.detail}")
        if progress.stage == "accepted" and now - sent >= MODEL_RESEND_S and st.healthy:
            yield from model_set(name, context_tokens, deadline, batch, parallelism, kv_bits)
            sent = now
        yield Sleep(POLL_S)


def model_name(model: str | os.PathLike[str]) -> str:
    """What to send as the model's name. A local directory is made absolute, because the
    agent may run in another working directory; anything else (a Hugging Face id, a name
    under the agent's model root) goes as given."""
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model):
        raise BadRequest("load needs a model: a local directory in the Hugging Face layout or a Hugging Face id (org/name)")
    if isinstance(model, os.PathLike) or Path(model).expanduser().is_dir():
        path = Path(os.fspath(model)).expanduser()
        if path.is_dir():
            return str(path.resolve())
        return str(path)
    return str(model)


def model_ready(quorum_timeout_s: float) -> Plan[Status]:
    """Before a generation: the cluster must have a model. Without one the agent would hold
    the request for two minutes before failing it; this fails at once with the fix."""
    st = yield from status()
    if not formed(st):
        st = yield from healthy(quorum_timeout_s)
    if st.placement is None or st.placement.model is None:
        raise ModelNotLoaded("the cluster serves no model yet: load one first (client.load(PATH_OR_HF_ID), "
                             "or `p2pmesh model set PATH_OR_HF_ID`)")
    if st.placement.problem is not None:
        raise refused(st.placement.problem)
    return st


def generate_fields(prompt: str, max_tokens: int, temperature: float, top_p: float, seed: int) -> dict[str, Any]:
    if not isinstance(prompt, str):
        raise BadRequest(f"generate needs the prompt as text, got {type(prompt).__name__}")
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}


def generate(fields: dict[str, Any], quorum_timeout_s: float) -> Plan[dict[str, Any]]:
    yield from model_ready(quorum_timeout_s)
    return {"op": "generate", **fields}


def chat(messages: Sequence[Mapping[str, Any]], fields: dict[str, Any], quorum_timeout_s: float,
            model_root: Path | None) -> Plan[dict[str, Any]]:
    msgs = check_messages(messages)
    st = yield from model_ready(quorum_timeout_s)
    assert st.placement is not None and st.placement.model is not None
    name = st.placement.model
    prompt = yield Blocking(lambda: chat_prompt(name, msgs, model_root, st.state_dir))
    return {"op": "generate", **fields, **prompt}



def watch(interval_s: float) -> Plan[None]:
    """Poll and diff. Nothing runs while the consumer does not ask for the next event, so
    there is no backlog to bound: a slow consumer sees the changes between two polls
    coalesced (a member that joined and left meanwhile is not reported)."""
    prev = yield from status()
    while True:
        yield Sleep(interval_s)
        cur = yield from status()
        for event in diff(prev, cur):
            yield Emit(event)
        prev = cur



def leave(timeout_s: float) -> Plan[bool]:
    answer = yield from ask_answer({"op": "leave", "timeout_s": timeout_s}, timeout_s + REQUEST_TIMEOUT_S)
    # `confirmed`: the cluster committed this Mac's removal (an agent that only stopped at
    # its deadline has `left` but not `confirmed`); older agents answer `left` alone.
    return bool(answer.get("confirmed", answer.get("left")))


PAIR_IDLE_GRACE_S = 30.0
"""A pairing's events may pause for its whole window (waiting for the other Mac) and then
some: the connection fails only after the window and this grace without a line."""


def pair(join: bool, window_s: float, answer: Callable[[dict[str, Any]], bool]) -> Plan[None]:
    """`p2pmesh pair`'s conversation (docs/pairing.md): emit each of the agent's events (its
    JSON objects) until the final one. An event with a "question" is answered, once it was
    emitted, with `answer(event)` (blocking work: it may ask a person): True only for a clear
    yes."""
    request = {"op": "pair", "join": join, "timeout_s": window_s}
    yield from events(request, window_s + PAIR_IDLE_GRACE_S, "pairing", answer)
