"""`llmcli run --trace` (issue 61): each step of one answer — the prompt as tokens, the prefill, every token with its
candidates as the model scored them and as the sampler chain left them, the stop, the summary — on stderr, and as
JSON lines with --trace-json. Asserted on the JSON events: properties of llama.cpp's own sampler chain, never
particular words (greedy text differs between CPUs)."""

from __future__ import annotations

import json
from pathlib import Path

import pyte
import pytest
from conftest import run_cli, run_in_terminal

PROMPT = "Say hi."


def traced(tmp_path: Path, *args: str) -> tuple[dict, list[dict], str]:
    """The answer's --json record, the trace's events, and stderr."""
    events_file = tmp_path / "trace.jsonl"
    result = run_cli("run", "--json", "--trace-json", str(events_file), *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout), [json.loads(line) for line in events_file.read_text().splitlines()], result.stderr


def test_a_greedy_trace_shows_the_prompt_the_prefill_each_token_as_its_argmax_the_stop_and_the_summary(tmp_path):
    record, events, stderr = traced(tmp_path, "--temp", "0", "-n", "12", PROMPT)
    stages = [event["stage"] for event in events]
    assert stages[:2] == ["prompt", "prefill"] and stages[-2:] == ["stop", "summary"]
    assert set(stages[2:-2]) == {"token"}
    prompt = events[0]
    count = json.loads(run_cli("count", "--chat", "--json", PROMPT).stdout)["total"]
    assert prompt["count"] == len(prompt["tokens"]) == count  # (the tokens `llmcli count --chat` counts)
    assert prompt["parts"]["message"] == 3 and sum(prompt["parts"].values()) == count
    assert events[1]["evaluated"] + events[1]["cached"] == count and events[1]["kv_bytes"] > 0
    assert events[1]["batches"] >= 1 and "evaluated in " in stderr
    tokens = [event for event in events if event["stage"] == "token"]
    assert [t["index"] for t in tokens] == list(range(len(tokens))) and tokens[0]["first"]
    assert "".join(t["chosen"]["piece"] for t in tokens if not t["chosen"]["special"]) == record["text"]
    for token in tokens:  # greedy: each chosen token is the argmax of what the sampler left (and of the model's)
        best = max(token["candidates"], key=lambda c: c["p_sampler"])
        assert token["how"] == "argmax" and best["id"] == token["chosen"]["id"] and token["chosen"]["p"] == best["p_sampler"]
        assert token["changed"] == [] and token["stages"][-1][0] == "greedy"
    assert events[-2]["reason"] == record["finish_reason"] and events[-2]["shown"] == record["text"]
    assert events[-1]["ttft_s"] > 0 and events[-1]["kv_used"] == count + record["usage"]["completion_tokens"]
    assert "prompt · " in stderr and "TTFT" in stderr and "summary · " in stderr  # (the terminal view, on stderr)
    ids = run_cli("run", "--trace", "--trace-ids", "--temp", "0", "-n", "1", PROMPT)
    assert f"[{prompt['tokens'][0]['id']}]" in ids.stderr  # (--trace-ids: each prompt piece followed by its id)


def test_top_p_keeps_the_smallest_set_that_reaches_p_and_its_probabilities_sum_to_one(tmp_path):
    _, events, _ = traced(tmp_path, "--temp", "1", "--top-p", "0.5", "--min-p", "0", "--seed", "3", "-n", "6",
                          "--trace-top", "50", PROMPT)
    for token in (event for event in events if event["stage"] == "token"):
        names = [name for name, _ in token["stages"]]
        assert names[:2] == ["top-k", "top-p"] and token["how"] == "drawn" and "top-p" in token["changed"]
        ranked = sorted(token["candidates"], key=lambda c: -c["p_model"])[:40]  # (what top-k 40 left, by the model)
        total = sum(c["p_model"] for c in ranked)
        reached, needed = 0.0, 0
        for candidate in ranked:
            reached += candidate["p_model"] / total
            needed += 1
            if reached >= 0.5:
                break
        kept = [c for c in token["candidates"] if c["p_sampler"] > 0]
        assert token["stages"][1][1] == needed == len(kept)  # the smallest set that reaches 0.5
        assert {c["id"] for c in kept} == {c["id"] for c in ranked[:needed]}
        assert sum(c["p_sampler"] for c in kept) == pytest.approx(1.0)
        assert token["chosen"]["id"] in {c["id"] for c in kept}


def test_repeat_last_n_minus_one_penalises_the_whole_answer_where_zero_penalises_nothing(tmp_path):
    """`--repeat-last-n -1` is the whole context, as its help says (llama.cpp's C API took -1 as none): the trace
    shows the penalties changing the distribution once the answer has tokens; with 0 they never do."""
    def changed_by_penalties(last_n: str) -> list[bool]:
        _, events, _ = traced(tmp_path, "--temp", "0", "--repeat-penalty", "1.5", "--repeat-last-n", last_n, "-n", "8",
                              PROMPT)
        return [("penalties" in event["changed"]) for event in events if event["stage"] == "token"]

    whole_context, none = changed_by_penalties("-1"), changed_by_penalties("0")
    assert not whole_context[0] and any(whole_context[1:]) and not any(none)


def test_a_grammar_masks_what_it_forbids_and_a_stop_sequence_is_named_with_what_it_held_back(tmp_path):
    record, events, _ = traced(tmp_path, "--temp", "0", "--grammar", 'root ::= "yes" | "no"', "Is the sky blue?")
    first = next(event for event in events if event["stage"] == "token")
    allowed = {"y", "ye", "yes", "n", "no"}
    for candidate in first["candidates"]:
        assert candidate["p_sampler"] == 0.0 or candidate["piece"] in allowed, candidate
    assert any(c["p_sampler"] == 0.0 and c["p_model"] > 0 for c in first["candidates"])  # (the model's own choices, masked)
    assert "grammar" in first["changed"] or "grammar" in first.get("note", "")
    assert record["text"] in ("yes", "no")
    record, events, stderr = traced(tmp_path, "--temp", "0", "--grammar", 'root ::= "alpha beta gamma"', "--stop",
                                    " beta", PROMPT)
    stop = next(event for event in events if event["stage"] == "stop")
    assert stop["reason"] == "stop_sequence" and stop["stop_sequence"] == " beta" and stop["shown"] == "alpha"
    assert record["text"] == "alpha" and "the stop sequence ' beta' (held back, never shown)" in stderr


def test_a_warm_answer_s_trace_is_the_in_process_one(tmp_path):
    """The default path (a warm server: its engine traces, the steps come back in SSE comments) and an answer made in
    this process trace the same steps: the same tokens, chosen the same way, from the same candidates (a grammar holds
    the text: a server's slot and one sequence round differently)."""
    args = ["--temp", "0", "--grammar", 'root ::= "The sky is blue because of Rayleigh scattering."', PROMPT]
    warm, warm_events, _ = traced(tmp_path, *args)
    here, here_events, _ = traced(tmp_path, "--keep-alive", "0", *args)
    assert here["text"] == warm["text"] and "smollm2" in run_cli("ps").stdout.lower()  # (the first: a warm server's)
    tokens = [[e for e in events if e["stage"] == "token"] for events in (warm_events, here_events)]
    assert [t["chosen"]["id"] for t in tokens[0]] == [t["chosen"]["id"] for t in tokens[1]]
    for mine, theirs in zip(*tokens, strict=True):
        assert mine["how"] == theirs["how"] and mine["stages"] == theirs["stages"]
        assert mine["chosen"]["p"] == pytest.approx(theirs["chosen"]["p"], abs=0.02)
    assert [e["stage"] for e in warm_events] == [e["stage"] for e in here_events]
    assert warm_events[0] == here_events[0]  # (the prompt: the same tokens, rendered here with the vocabulary)
    for events, first in zip((warm_events, here_events), (tokens[0][0], tokens[1][0]), strict=True):
        assert first["seconds"] == events[-1]["ttft_s"]  # (the first token, marked as the TTFT, is the summary's:
        # warm, the client's time since it asked, not the server's since it read the request)


def test_chat_s_trace_command_traces_the_next_replies_until_it_is_turned_off():
    """chat's `/trace on [N]` (through its warm server, the default): the next replies' steps on stderr, as run's —
    the prompt of the message after the conversation first; `/trace off` ends it; a bad argument is one usage line."""
    result = run_cli("chat", "--no-save", "--temp", "0", "-n", "4", "--grammar", 'root ::= "one two three four five"',
                     input="/trace on 3\nSay hi.\n/trace off\nSay hi.\n/trace maybe\n")  # (4 tokens on any CPU)
    assert result.code == 0, result.stderr
    assert result.stderr.count("prefill · ") == 1 and result.stderr.count("summary · ") == 1, result.stderr
    assert result.stderr.count("prompt · ") == 1 and "message 3)" in result.stderr  # (the message's prompt first)
    assert "#3 " in result.stderr and "#4 " not in result.stderr  # (-n 4: tokens 0 to 3)
    assert "usage: /trace on [N]" in result.stderr


class _Screen(pyte.Screen):
    """pyte's terminal screen, plus what pyte leaves out and the view uses: half intensity (SGR 2, the candidates),
    kept per cell in `dimmed`."""

    def __init__(self, columns: int, lines: int):
        super().__init__(columns, lines)
        self.dim, self.dimmed = False, set()

    def select_graphic_rendition(self, *attrs: int, **kwargs: object) -> None:
        for attr in attrs or (0,):
            self.dim = True if attr == 2 else False if attr in (0, 22) else self.dim
        super().select_graphic_rendition(*attrs, **kwargs)

    def draw(self, data: str) -> None:
        for char in data:
            super().draw(char)
            cell = (self.cursor.y, self.cursor.x - 1)
            self.dimmed.discard(cell)
            if self.dim:
                self.dimmed.add(cell)


def _pyte_colour(name: str) -> str | None:
    if name == "default":
        return None
    if len(name) == 6 and all(c in "0123456789abcdefABCDEF" for c in name):
        return "#" + name
    name = name.replace("brown", "yellow")
    return "bright_" + name[len("bright"):] if name.startswith("bright") else name


def test_the_terminal_view_is_drawn_in_colour():
    """The view as a terminal shows it: `run --trace` on a pseudo-terminal, its bytes played through pyte, a terminal
    emulator (the pieces' alternating backgrounds, the candidates dimmed, the stages that changed in cyan); the
    emulator's final screen, cell by cell, drawn into a picture: LLMCLI_TRACE_SCREENSHOT=PATH writes the README's
    (an SVG)."""
    import io
    import os

    from rich.console import Console
    from rich.style import Style
    from rich.text import Text

    width = 112
    shown = run_in_terminal(["run", "--trace", "--temp", "0.7", "--top-k", "20", "--top-p", "0.9", "--seed", "4", "-n",
                             "6", "Name a colour."], {"NO_COLOR": "", "TERM": "xterm-256color", "COLUMNS": str(width)},
                            stderr=True)
    screen = _Screen(width, 80)
    pyte.ByteStream(screen).feed(shown)
    rows = [line.rstrip() for line in screen.display]
    while rows and not rows[-1]:
        rows.pop()
    plain = "\n".join(rows)
    assert "top-k › top-p › temp" in plain and "summary · " in plain and "prompt · " in plain, plain
    cells = [screen.buffer[y][x] for y in range(len(rows)) for x in range(width)]
    assert any(c.fg == "cyan" for c in cells) and any(c.bg != "default" for c in cells) and screen.dimmed

    picture = Text()
    for y in range(len(rows)):
        run, style = "", None
        for x in range(len(rows[y])):
            cell = screen.buffer[y][x]
            looks = Style(color=_pyte_colour(cell.fg), bgcolor=_pyte_colour(cell.bg), bold=cell.bold,
                          italic=cell.italics, underline=cell.underscore, reverse=cell.reverse,
                          dim=(y, x) in screen.dimmed)
            if looks != style and run:
                picture.append(run, style)
                run = ""
            run, style = run + cell.data, looks
        picture.append(run + "\n", style)
    console = Console(record=True, width=width, force_terminal=True, color_system="truecolor", file=io.StringIO())
    console.print(picture, highlight=False, end="")
    svg = console.export_svg(title="llmcli run --trace")
    assert svg.startswith("<svg") and "summary" in svg
    if os.environ.get("LLMCLI_TRACE_SCREENSHOT"):
        Path(os.environ["LLMCLI_TRACE_SCREENSHOT"]).write_text(svg)


def test_trace_is_refused_where_it_cannot_see_the_sampler(tmp_path):
    unwritable = run_cli("run", "--trace-json", str(tmp_path / "no" / "such" / "t.jsonl"), PROMPT)
    assert unwritable.code == 2 and unwritable.stderr.startswith("Error: --trace-json") and "Traceback" not in unwritable.stderr
    for args, words in ((["--endpoint", "http://127.0.0.1:9/v1"], "--endpoint's server samples"),
                        (["--batch", "-"], "drop --trace")):
        result = run_cli("run", "--trace", *args, *([] if "--batch" in args else [PROMPT]), input="hi\n")
        assert result.code == 2 and words in result.stderr, result.stderr


def test_a_stage_that_moves_a_few_logits_is_folded_into_the_softmax_as_a_whole_one_would_compute_it():
    """The trace's cheap path (trace_distribution.fold: a bias or penalties moved a few logits of the whole vocabulary)
    against a softmax computed whole; a stage that moved nothing is the distribution before it; a logit far above
    the rest, or the mass moved off what was left, is computed whole; rows a stage reordered are read by their ids."""
    import numpy as np

    from llmcli.llama.trace_distribution import CHANGED, fold, stage_distribution, whole

    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, 5000).astype(np.float32)
    start = whole(logits)
    in_order = np.arange(5000, dtype=np.int32)
    view = np.zeros(5000, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    view["id"], view["logit"] = in_order, logits
    assert stage_distribution(view, True, start, in_order) is start  # (nothing moved: nothing computed)

    def softmax(values: np.ndarray) -> np.ndarray:
        p = np.exp((values - values.max()).astype(np.float64))
        return p / p.sum()

    top = int(np.argmax(logits))
    for moved in ({3: -np.inf, 10: logits[10] + 2, 11: logits[11] - 1}, {top: -np.inf}, {top: logits[top] - 0.5},
                  {5: logits.max() + 900}, {7: logits.max() + 30}):
        changed = view.copy()
        for token, value in moved.items():
            changed["logit"][token] = value
        after = stage_distribution(changed, True, start, in_order)
        expected = softmax(changed["logit"])
        assert after.ids is None and np.allclose(after.dense(5000), expected, rtol=1e-5, atol=1e-12), moved
        for token in moved:
            assert after.probs([token])[0] == pytest.approx(expected[token], rel=1e-5, abs=1e-12)
        weights = np.exp((changed["logit"] - after.top).astype(np.float64))
        assert np.allclose(after.weighed(), weights, rtol=1e-5, atol=1e-30)  # (what a cut after it sums)
        largest = float(np.abs(expected - softmax(logits)).max())
        measured = after.change if after.change is not None else largest  # (a fold's: one difference past
        assert measured <= largest * (1 + 1e-4) + 1e-12, moved  # CHANGED where there is one, else the largest)
        assert (measured > CHANGED) == (largest > CHANGED), moved
        if not largest > CHANGED:
            assert measured == pytest.approx(largest, rel=1e-4, abs=1e-15), moved
    flat = whole(rng.normal(0, 0.5, 5000).astype(np.float32))  # (flat: one token nudged moves the others'
    nudged = flat.logits.copy()  # probabilities by less than CHANGED, its own by more — the fold's change is its)
    nudged[9] += np.float32(1e-3)
    after = fold(flat, np.array([9]), nudged[[9]])
    assert after is not None and after.change is not None and after.change > CHANGED
    assert after.change == pytest.approx(float(np.abs(softmax(nudged) - softmax(flat.logits)).max()), rel=1e-3)
    many = logits.copy()  # (more moved than FOLDED: folded as arrays)
    many[100:200] -= np.float32(1)
    after = fold(start, np.arange(100, 200), many[100:200])
    assert after is not None and np.allclose(after.probs(list(range(90, 210))), softmax(many)[90:210], rtol=1e-5)
    assert after.change is not None and after.change > CHANGED
    swapped = view.copy()
    swapped[[20, 21]] = swapped[[21, 20]]  # (two rows moved whole: the same tokens, the same logits)
    swapped["logit"][20] += 1  # (token 21's, now in row 20)
    after = stage_distribution(swapped, True, start, in_order)
    bumped = logits.copy()
    bumped[21] += 1
    assert np.allclose(after.dense(5000), softmax(bumped), rtol=1e-5, atol=1e-12)


def test_a_top_k_or_greedy_after_a_bias_or_penalties_is_given_a_few_rows_and_chooses_as_the_whole_vocabulary_does():
    """The trace gives a top-k (or greedy) after stages that move a few known tokens (a logit bias, penalties) only
    those tokens and the model's largest: with llama.cpp's own samplers on random logits, the token, the stages'
    sizes and the final distribution are the ones the same chain gives applied to the whole vocabulary — a bias that
    lifts a low token into the top, one that bans the favourite, penalties over a short window — and a tie at the
    top-k's edge is handed to the whole vocabulary (where llama.cpp's order decides it)."""
    import ctypes
    from collections import deque
    from types import SimpleNamespace

    import llama_cpp
    import numpy as np

    from llmcli.llama import sampler_trace
    from llmcli.llama.sampler_trace import _sparse, _through, whole
    from llmcli.llama.traced_token import ModelTop, candidate_array, chain_stages

    n = 5000
    rng = np.random.default_rng(3)

    def chain_of(settings: tuple) -> object:
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        for kind, *args in settings:
            if kind == "bias":
                biases = (llama_cpp.llama_logit_bias * len(args[0]))(*(llama_cpp.llama_logit_bias(t, b) for t, b in args[0]))
                stage = llama_cpp.llama_sampler_init_logit_bias(n, len(args[0]), biases)
            elif kind == "penalties":
                stage = llama_cpp.llama_sampler_init_penalties(n, args[0], 1.5, 0.0, 0.5)
            elif kind == "top-k":
                stage = llama_cpp.llama_sampler_init_top_k(args[0])
            elif kind == "temp":
                stage = llama_cpp.llama_sampler_init_temp(args[0])
            elif kind == "greedy":
                stage = llama_cpp.llama_sampler_init_greedy()
            else:
                stage = llama_cpp.llama_sampler_init_dist(7)
            llama_cpp.llama_sampler_chain_add(chain, stage)
        return chain

    def sampler_of(settings: tuple) -> SimpleNamespace:
        biased = tuple(t for kind, *args in settings if kind == "bias" for t, _ in args[0])
        window = next((args[0] for kind, *args in settings if kind == "penalties"), None)
        top_k = next((args[0] for kind, *args in settings if kind == "top-k"), 0)
        return SimpleNamespace(chain=chain_of(settings), top_k=top_k, biased=biased,
                               recent=None if window is None else deque(maxlen=window))

    def reference(chain: object, logits: np.ndarray) -> tuple[int, list[int], np.ndarray]:
        data = (llama_cpp.llama_token_data * n)()
        rows = np.ctypeslib.as_array(data)
        rows["id"], rows["logit"] = np.arange(n), logits
        array = llama_cpp.llama_token_data_array(data, n, -1, False)
        sizes = []
        for i in range(llama_cpp.llama_sampler_chain_n(chain)):
            llama_cpp.llama_sampler_apply(llama_cpp.llama_sampler_chain_get(chain, i), ctypes.byref(array))
            sizes.append(int(array.size))
        left = np.ctypeslib.as_array(array.data, shape=(int(array.size),))
        token = int(left["id"][array.selected]) if array.selected >= 0 else int(left["id"][np.argmax(left["logit"])])
        llama_cpp.llama_sampler_accept(chain, token)
        final = np.zeros(n)
        weights = np.exp((left["logit"] - left["logit"].max()).astype(np.float64))
        final[left["id"]] = weights / weights.sum()
        return token, sizes, final

    spread = rng.normal(0, 3, n).astype(np.float32)
    favourite, low = int(spread.argmax()), int(spread.argmin())
    cases = [(("bias", ((low, 40.0), (favourite, float("-inf")), (n + 5, 1.0))), ("top-k", 40), ("temp", 0.8),
              ("dist",)),
             (("penalties", 3), ("top-k", 5), ("dist",)),
             (("bias", ((low, 40.0),)), ("penalties", 4), ("greedy",)),
             (("penalties", 64), ("greedy",))]
    for settings in cases:
        traced, plain = sampler_of(settings), chain_of(settings)
        for round_ in range(12):
            logits = spread.copy() if round_ % 3 == 0 else rng.normal(0, 3, n).astype(np.float32)
            if traced.recent:  # (the tokens just chosen near the top again: the penalties move the top)
                logits[list(traced.recent)] = logits.max() + rng.normal(0, 0.5, len(traced.recent)).astype(np.float32)
            start, top = whole(logits), ModelTop(logits)
            buffer = candidate_array(traced, n)
            assert _sparse(traced, "chain", (), start, buffer, top) is None  # (nothing to apply)
            stages, _, final, token, _ = _through(traced, "chain", start, buffer, top)
            expected, sizes, reference_final = reference(plain, logits)
            assert token == expected and [size for _, size in stages] == sizes[:len(stages)], (settings, round_)
            shown = np.argsort(-reference_final)[:10]
            assert np.allclose(final.probs(shown.tolist()), reference_final[shown], rtol=1e-4, atol=1e-7)
        assert len(traced.recent or ()) == min(12, traced.recent.maxlen if traced.recent is not None else 0)

    tied = np.full(n, -60.0, dtype=np.float32)
    tied[:4] = (10.0, 9.0, 8.0, 8.0)  # (a top-k of 3 would leave out a token as likely as one it keeps)
    for k, sparse in ((2, True), (3, False)):
        traced = sampler_of((("bias", ((100, 1.0),)), ("top-k", k), ("dist",)))
        given = _sparse(traced, "chain", chain_stages(traced, "chain"), whole(tied), candidate_array(traced, n), ModelTop(tied))
        assert (given is not None) == sparse, k
    assert sampler_trace.SPARSE >= 64  # (a default window of penalties is given alone)


def test_the_model_s_top_and_a_cut_s_change_are_found_as_a_whole_vocabulary_computation_finds_them():
    """The trace's shortcuts against the plain computations: the k largest logits from a strided sample's floor
    (logprobs.largest) against a sort, ties, masks and short arrays included; whether a top-k cut changed the
    distribution (the left-out weights, the kept ones renormalized) and a cut of a cut's first candidates (top-p,
    min-p) against the whole vocabulary compared."""
    import numpy as np

    from llmcli.llama.logprobs import largest
    from llmcli.llama.trace_distribution import CHANGED, cut, differs, stage_distribution, whole

    rng = np.random.default_rng(11)
    for n, k in ((49152, 5), (49152, 1), (2000, 40), (100, 5), (7, 7)):
        values = rng.normal(0, 3, n).astype(np.float32)
        values[rng.integers(0, n, 3)] = values.max()  # (ties at the top)
        assert sorted(values[largest(values, k)].tolist()) == sorted(np.sort(values)[n - k:].tolist()), (n, k)
    strided = rng.normal(0, 1, 49152).astype(np.float32)
    strided[::64] += 100  # (the sample holds the largest: the likely floor holds too few, the sure one is taken)
    for k in (5, 41, 100, 800):
        assert sorted(strided[largest(strided, k)].tolist()) == sorted(np.sort(strided)[-k:].tolist()), k
    masked = np.full(49152, -np.inf, dtype=np.float32)
    masked[[5, 900, 40000]] = (1.0, 3.0, 2.0)  # (a grammar's mask: three left)
    assert sorted(largest(masked, 2).tolist()) == [900, 40000]
    assert set(largest(masked, 5).tolist()) >= {5, 900, 40000} and len(largest(masked, 5)) == 5

    def top_k(before, k: int):
        ids = np.argsort(-before.logits, kind="stable")[:k].astype(np.int32)
        return cut(ids, before.logits[ids].copy())

    confident = np.full(5000, -60.0, dtype=np.float32)
    confident[:3] = (10.0, 9.0, 8.0)
    tied = confident.copy()
    tied[3] = 8.0  # (the cut at 3 leaves out a token as likely as one it kept)
    near = np.full(5000, -19.0, dtype=np.float32)  # (each left out below CHANGED, together above it)
    near[:2] = (2.0, 1.0)
    spread = rng.normal(0, 3, 5000).astype(np.float32)
    for logits, k in ((spread, 40), (confident, 3), (confident, 2), (tied, 3), (confident, 5000), (near, 2)):
        before = whole(logits)
        after = top_k(before, k)
        whole_p = np.exp((logits - logits.max()).astype(np.float64))
        largest_change = float(np.abs(after.dense(5000) - whole_p / whole_p.sum()).max())
        assert differs(before, after, 5000) == (largest_change > CHANGED), k
        for m in range(1, k if k < 50 else 40):  # (a cut of the first m it left)
            view = np.zeros(m, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
            view["id"], view["logit"] = after.ids[:m], after.logits[:m]
            prefix = stage_distribution(view, False, after, np.arange(5000, dtype=np.int32))
            kept = np.exp((after.logits[:m] - after.logits[:m].max()).astype(np.float64))
            assert np.allclose(prefix.dense(5000)[after.ids[:m]], kept / kept.sum(), rtol=1e-9)
            change = float(np.abs(prefix.dense(5000) - after.dense(5000)).max())
            assert (prefix.change if prefix.change is not None else change) == pytest.approx(change, rel=1e-6, abs=1e-15)
    assert differs(whole(tied), top_k(whole(tied), 3), 5000)  # (the tie left out: p 0.08)

    assert differs(whole(near), top_k(whole(near), 2), 5000)  # (4,998 tokens of p ~1e-9 left out: ~1e-6 in all)


def test_the_observed_chain_s_folds_and_cuts_are_a_whole_vocabulary_computation_s():
    """The observed path's readings (sampler_trace._moved_by, _cut_from_whole, _cut_of_cut: plain lists, no numpy
    pass) against the whole vocabulary's probabilities in float64: a bias that moves tokens up and down (two in
    opposite directions whose own changes nearly cancel: the others' rescaling decides), one on the most likely, a
    first cut that leaves out much or nearly nothing, a cut of a cut's first candidates, a temperature."""
    import math

    import numpy as np

    from llmcli.llama.observed_trace import CHANGED, _cut_from_whole, _cut_of_cut, _moved_by, _softmax, _Whole

    def dense(logits: np.ndarray) -> np.ndarray:
        weights = np.exp(logits.astype(np.float64) - logits.astype(np.float64).max())
        return weights / weights.sum()

    rng = np.random.default_rng(5)
    spread = rng.normal(0, 3, 5000).astype(np.float32)
    peaked = np.full(5000, -30.0, dtype=np.float32)
    peaked[:3] = (12.0, 4.0, 3.5)
    favourite = int(spread.argmax())
    sure = np.zeros(5000, dtype=np.float32)
    sure[0] = 25.0  # (the others ~1e-11 each: 2,000 of them raised 20-fold change by less than CHANGED each, the
    many = dict.fromkeys(range(1000, 3000), 3.0)  # favourite's share by more: the rescaling decides)
    for logits, moves in ((spread, {favourite: -3.0, 17: 2.0}), (spread, {3: 1e-3, 4: -1e-3}), (sure, many),
                          (peaked, {0: -20.0}), (peaked, {4000: 5.0}), (spread, {9: float("-inf")})):
        state = _Whole(logits, float(logits.max()), np.empty_like(logits))
        tokens = sorted(moves)
        after = logits.copy()
        for token in tokens:
            after[token] = np.float32(logits[token] + np.float32(moves[token]))
        change = _moved_by(state, tokens, after[tokens].tolist())
        truth = float(np.abs(dense(after) - dense(logits)).max())
        assert change is not None and (change > CHANGED) == (truth > CHANGED), (moves, change, truth)
        assert change == pytest.approx(truth, rel=1e-4, abs=1e-12), moves
        for token in (*tokens, favourite, 0):
            assert state.p(token) == pytest.approx(dense(after)[token], rel=1e-5, abs=1e-15)
    for logits, k in ((spread, 40), (peaked, 3), (peaked, 2), (peaked, 5000)):
        state = _Whole(logits, float(logits.max()), np.empty_like(logits))
        ids = np.argsort(-logits, kind="stable")[:k].tolist()
        kept = logits[ids].tolist()
        p = _softmax(kept)
        cut = np.zeros(5000)
        cut[ids] = p
        truth = float(np.abs(cut - dense(logits)).max())
        assert (_cut_from_whole(state, ids, kept, p) > CHANGED) == (truth > CHANGED), k
        for m in range(1, min(k, 12)):  # (a cut of its first m; and a temperature of them all)
            after_p, change = _cut_of_cut(ids, kept, p, ids[:m], kept[:m])
            assert after_p == pytest.approx(_softmax(kept[:m]), rel=1e-12)
            assert change == pytest.approx(float(np.abs(np.array(after_p + [0.0] * (k - m)) - p).max()), rel=1e-9)
        hotter = [x / 2 for x in kept]
        after_p, change = _cut_of_cut(ids, kept, p, ids, hotter)
        assert change == pytest.approx(max(abs(a - b) for a, b in zip(after_p, p, strict=True)), rel=1e-12) and math.isclose(
            sum(after_p), 1.0)


def test_a_bias_s_observer_narrows_greedy_s_candidates_and_greedy_still_takes_the_token_it_would_have():
    """Greedy after a logit bias: the bias's observer keeps the largest few (llama.cpp's top-k, in C) for greedy to
    choose among — the first largest of the whole vocabulary in its order (the lowest id of those tied) is put first,
    whether the tie is among those kept or wider than them."""
    import ctypes

    import llama_cpp

    from llmcli.llama.stage_observation import Seen

    greedy = llama_cpp.llama_sampler_init_greedy()
    try:
        for tied, narrow in (((30, 7), 3), ((41, 12, 5, 33, 20), 3), ((), 3), ((9,), 1)):
            n = 50
            data = (llama_cpp.llama_token_data * n)(*(llama_cpp.llama_token_data(i, (i * 7919 % 97) / 100, 0.0)
                                                       for i in range(n)))
            for token in tied:
                data[token].logit = 5.0
            array = llama_cpp.llama_token_data_array(data, n, -1, False)
            whole = max(range(n), key=lambda i: (data[i].logit, -i))  # (greedy on the whole array: first largest)
            seen = Seen("logit-bias", n)
            seen.touched, seen.narrow = (lambda: [2]), narrow
            read = [data[2].logit]  # (the biased token's logit, read before the cut)
            seen.take(ctypes.addressof(array))
            assert int(array.size) == narrow and seen.moved == read
            llama_cpp.llama_sampler_apply(greedy, ctypes.byref(array))
            assert data[array.selected].id == whole, (tied, whole)
            ids, logits = seen.rows()
            assert ids[0] == whole and logits == sorted(logits, reverse=True)
            seen.close()
    finally:
        llama_cpp.llama_sampler_free(greedy)


def test_a_traced_token_is_the_plain_one_and_each_stage_is_as_a_whole_vocabulary_computation_sees_it(smollm2):
    """sample_traced on a real model's logits, in lockstep with a second sampler of the same settings and seed that
    applies llama.cpp's stages one by one to the whole vocabulary and computes every distribution whole: the same
    tokens (a bias on the model's favourite, penalties, top-k, top-p, min-p, typical-p, DRY, mirostat), the same
    stages and sizes, the same stages changing the distribution, and each candidate's p_sampler the reference's."""
    import ctypes

    import llama_cpp
    import numpy as np

    from llmcli.answer.sampling_config import SamplingConfig
    from llmcli.llama.engine import Engine
    from llmcli.llama.engine_config import EngineConfig
    from llmcli.llama.sampler_trace import CHANGED, SELECTORS, sample_traced

    def reference(sampler, n_vocab: int) -> tuple[int, list, dict[str, float], np.ndarray]:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(sampler.ctx, -1), shape=(n_vocab,)).copy()
        data = (llama_cpp.llama_token_data * n_vocab)()
        rows = np.ctypeslib.as_array(data)
        rows["id"], rows["logit"] = np.arange(n_vocab), logits
        array = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
        before = np.exp((logits - logits.max()).astype(np.float64))
        before /= before.sum()
        stages, changes = [], {}
        chain = sampler.chain
        for i in range(llama_cpp.llama_sampler_chain_n(chain)):
            stage = llama_cpp.llama_sampler_chain_get(chain, i)
            name = llama_cpp.llama_sampler_name(stage).decode()
            llama_cpp.llama_sampler_apply(stage, ctypes.byref(array))
            stages.append([name, int(array.size)])
            if name in SELECTORS:
                break
            left = np.ctypeslib.as_array(array.data, shape=(int(array.size),))
            after = np.zeros(n_vocab)
            finite = left["logit"] > -np.inf
            kept = np.exp((left["logit"][finite] - left["logit"][finite].max()).astype(np.float64))
            after[left["id"][finite]] = kept / kept.sum()
            changes[name] = float(np.abs(after - before).max())
            before = after
        left = np.ctypeslib.as_array(array.data, shape=(int(array.size),))
        token = int(left["id"][array.selected])
        llama_cpp.llama_sampler_accept(chain, token)
        return token, stages, changes, before

    with Engine(smollm2, EngineConfig(n_ctx=256, n_threads=1)) as engine:
        prompt = engine.vocab.tokenize("<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n")
        assert engine.prefill(prompt)
        favourite = int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(engine.llama_context, -1),
                                              shape=(engine.vocab.n_tokens,)).argmax())
        settings = [dict(temp=0, logit_bias=((favourite, -3.0), (100, 2.0), (200, float("-inf")))),
                    dict(temp=0, repeat_penalty=1.3, presence_penalty=0.2), dict(repeat_penalty=1.3),
                    dict(), dict(top_k=0, top_p=0.9), dict(top_k=0, min_p=0.1, temp=1.5), dict(typical_p=0.8),
                    dict(dry_multiplier=0.8, temp=0), dict(mirostat=2),
                    dict(logit_bias=((favourite, -3.0),), repeat_penalty=1.3, repeat_last_n=3),
                    dict(temp=0, repeat_penalty=1.3, repeat_last_n=-1)]
        read = [settings[i] for i in (0, 3, 4, 5)] + [dict(logit_bias=((favourite, 2.0),), top_k=5, min_p=0.2)]
        for options, observed in [(options, False) for options in settings] + [(options, True) for options in read]:
            # (observed: a traced answer's chain, read from inside llama.cpp's sampling where its shape is one read so)
            engine.kv.clear()
            assert engine.prefill(prompt)
            config = SamplingConfig(**options)
            with engine.sampler(config, 5, observed) as traced, engine.sampler(config, 5) as plain:
                for _ in range(8):
                    n_vocab = engine.vocab.n_tokens
                    step = sample_traced(traced, engine.vocab, -1, 8)
                    token, stages, changes, final = reference(plain, n_vocab)
                    assert step.token == token and [list(s) for s in step.stages] == stages, (options, observed)
                    for name, change in changes.items():  # (a change within 10x of the threshold may go either way)
                        if not CHANGED / 10 < change < CHANGED * 10:
                            assert (name in step.changed) == (change > CHANGED), (options, observed, name, change)
                    for candidate in step.candidates:
                        assert candidate.p_sampler == pytest.approx(final[candidate.token], rel=1e-4, abs=1e-7)
                    assert {c.token for c in step.candidates if c.p_sampler > 0} >= {
                        int(t) for t in np.argsort(-final)[:8] if final[t] > 1e-3}, options
                    assert engine.decode_one(token) == "ok"
                assert not observed or traced.observation.readable, options  # (read so, not stage by stage)


def test_a_warm_trace_s_first_token_time_is_the_answer_s_ttft_as_the_client_measures_it():
    """The first traced token is marked as the TTFT: on the warm path its time is the client's — since the request
    was made, as the summary's TTFT — not the server's, which starts when it read the request (the two lines of one
    screen said 0.044 and 0.054 s; then 0.021 and 0.022: the trace's line drawn before the text was read). No model:
    a traced token as llmcli serve writes it, read back by the client."""
    import time

    from llmcli.answer.events import Candidate, TokenTrace
    from llmcli.answer.openai_wire import ChunkReader
    from llmcli.answer.trace_wire import trace_wire

    def wire(index: int) -> dict:
        return {"llmcli_trace": trace_wire(TokenTrace(index, 42, b"hi", False, "argmax", 1.0,
                                                      (Candidate(42, b"hi", 0.0, 1.0, 1.0),), (("greedy", 1),), (), 0.004))}

    reader = ChunkReader((), time.perf_counter() - 5.0)  # (a request made 5 s ago: its server read it just now)
    first = next(iter(reader.events(wire(0), chat=True)))
    list(reader.events({"choices": [{"delta": {"content": "hi"}}]}, chat=True))  # (its text, read after the trace's
    second = next(iter(reader.events(wire(1), chat=True)))  # line was drawn)
    assert first.seconds >= 5.0 and second.seconds == 0.004  # (the next ones: the server's time between tokens)
    assert first.seconds == reader.done(interrupted=False)[1].stats.ttft_s
