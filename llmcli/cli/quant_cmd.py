"""`llmcli quantize` (a GGUF of another type, through llama.cpp's quantizer) and `llmcli quant advise` (which quant to
run on this machine: speed, memory and quality measured here)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmcli.cli import options as o

SourceArg = Annotated[str, typer.Argument(help="The model to quantize: a path, an installed model, a cached one.",
                                          show_default=False, autocompletion=o.complete_model)]
TypeOpt = Annotated[str, typer.Option("--type", "-q", help="The quantization type: F16, BF16, Q8_0, Q6_K, Q5_K_M, "
                                      "Q5_K_S, Q5_0, Q5_1, Q4_K_M, Q4_K_S, Q4_0, Q4_1, IQ4_NL, IQ4_XS, Q3_K_L, Q3_K_M, "
                                      "Q3_K_S, IQ3_M, IQ3_S, IQ3_XS, IQ3_XXS, Q2_K (the IQ1/IQ2 types need an "
                                      "importance matrix: refused).", show_default=False)]
OutputOpt = Annotated[Optional[Path], typer.Option(
    "--output", "-o", help="Write here; without it, into llmcli's store as NAME:type (`smollm2:q4_0`), which "
    "`llmcli list` shows and -m takes.", dir_okay=False, show_default=False)]
RequantizeOpt = Annotated[bool, typer.Option(
    "--allow-requantize", help="Quantize a file that is quantized already (its error and the new type's add up: "
    "worse than the same type made from F16/BF16).")]
OutputTypeOpt = Annotated[Optional[str], typer.Option(
    "--output-type", help="The output tensor's type (e.g. Q8_0, F16); default: llama.cpp's choice for --type.",
    show_default=False)]
EmbeddingTypeOpt = Annotated[Optional[str], typer.Option(
    "--embedding-type", help="The token embeddings' type (e.g. Q8_0); default: llama.cpp's choice for --type.",
    show_default=False)]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="Threads [default: the cores].",
                                                   show_default=False)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output, and skip the free-space check.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object on stdout: the result's name, path, size.")]


def quantize(source: SourceArg, type_name: TypeOpt, output: OutputOpt = None, allow_requantize: RequantizeOpt = False,
             output_type: OutputTypeOpt = None, embedding_type: EmbeddingTypeOpt = None, threads: ThreadsOpt = None,
             force: ForceOpt = False, as_json: JsonOpt = False) -> None:
    """Make a GGUF of another quantization type with llama.cpp's quantizer: free disk checked first, progress on
    stderr, and nothing left behind by Ctrl-C, SIGTERM or a full disk."""
    from llmcli.cli import output as out
    from llmcli.cli.models_cmd import _aliases
    from llmcli.errors import ExitCode, UsageError
    from llmcli.interrupt import Cancellation
    from llmcli.llama import quantize as q
    from llmcli.store import catalog, quantized
    from llmcli.store.gguf_header import read_header
    from llmcli.units import human_size

    console = out.stderr_console()
    type_name = q.check_type(type_name)
    tensor_types = (q.check_tensor_type(output_type, "--output-type"), q.check_tensor_type(embedding_type,
                                                                                           "--embedding-type"))
    model = catalog.local_model(source, _aliases())
    header = read_header(model.path)
    if q.requantizes(header) and not allow_requantize:
        raise UsageError(f"{model.name} is {header.quant} already: quantizing it again adds {type_name}'s error to "
                         f"{header.quant}'s", hint="Quantize the F16/BF16 file of the model, or pass "
                         "--allow-requantize to do it anyway (an F16 made so is the quantized model, unchanged).")
    if output is not None:
        target, name = output.expanduser().absolute(), None
        if target.parent.is_dir() is False:
            raise UsageError(f"-o {output}: the folder {target.parent} does not exist")
    else:
        name = quantized.reference_of(quantized.base_name(model.name), type_name)
        target = quantized.target(quantized.base_name(model.name), type_name)
        target.parent.mkdir(parents=True, exist_ok=True)
    if target.resolve() == model.path.resolve():
        raise UsageError("the output is the source file: write elsewhere with -o")
    if target.exists() and not force:
        raise UsageError(f"{name or target} exists already", hint="--force replaces it"
                         + (f"; `llmcli rm {name}` removes it." if name else "."))
    if not force:
        q.check_space(header, target, type_name)
    if q.requantizes(header) and not as_json:
        out.print_notice(console, f"requantizing {header.quant} to {type_name}: the result carries both types' error")
    job = q.QuantizeJob(str(model.path), str(target), type_name, allow_requantize, *tensor_types,
                        _threads(threads) or 0)
    cancel = Cancellation()
    started = time.perf_counter()
    try:
        with out.progress_bar(f"quantizing {model.name} to {type_name}") as advance:
            made = q.quantize(job, cancel, lambda done, total, tensor: advance(done, total, f"{type_name} · {tensor}"))
    except KeyboardInterrupt:
        console.print(f"quantize interrupted: nothing was written ({target.parent} is as it was)")
        import signal

        raise typer.Exit(ExitCode.TERMINATED if cancel.signum == signal.SIGTERM else ExitCode.INTERRUPTED) from None
    seconds = time.perf_counter() - started
    size = target.stat().st_size
    result = {"name": name, "path": str(target), "type": made.quant, "size_bytes": size, "source": model.name,
              "source_type": header.quant, "source_size_bytes": header.file_size, "seconds": round(seconds, 2)}
    if as_json:
        out.print_json(result)
        return
    console.print(f"{name or target}: {made.quant}, {human_size(size)} (from {header.quant}, "
                  f"{human_size(header.file_size)}) in {seconds:.1f} s" + (f"  {target}" if name else ""))


app = typer.Typer(help="Which quantization of a model to run here: `quant advise` measures and recommends.",
                  no_args_is_help=True)

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="The model (any file of it) [default: the "
                                                 "default model].", show_default=False, autocompletion=o.complete_model)]
MakeOpt = Annotated[Optional[str], typer.Option(
    "--make", help="Types to make from the highest-precision file first, comma-separated (Q4_0,Q4_K_M,Q5_K_M,Q8_0).",
    show_default=False)]
ReferenceOpt = Annotated[Optional[str], typer.Option(
    "--reference", "-r", help="Measure quality against this file [default: the highest-precision candidate].",
    show_default=False, autocompletion=o.complete_model)]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", min=256, help="The context you will run at: the KV cache's "
                                     "share of the memory.")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option("--max-memory", help="Memory the pick may take (8G, 512M) "
                                                     "[default: what is available].", show_default=False)]
MinDecodeOpt = Annotated[Optional[float], typer.Option("--min-decode", min=0, help="Decode tok/s the pick must reach.",
                                                       show_default=False)]
MaxKldOpt = Annotated[float, typer.Option("--max-kld", min=0, help="Mean KL divergence from the reference the pick "
                                          "may have.")]
KvTypeOpt = Annotated[str, typer.Option("--kv-type", help="KV cache types, comma-separated (f16,q8_0,q4_0): each file "
                                        "at each, its memory, speed and loss measured alike (use a long --eval-ctx).")]
TextOpt = Annotated[Optional[Path], typer.Option("--text", help="Quality's text [default: llmcli's own].",
                                                 dir_okay=False, show_default=False)]
HereOnlyOpt = Annotated[bool, typer.Option("--here-only", help="Only llmcli's own files (not Ollama's, LM Studio's "
                                           "or the Hugging Face cache's).")]
EvalCtxOpt = Annotated[int, typer.Option("--eval-ctx", min=16, max=32768, help="Quality's chunk length (eval "
                                         "quality's -c).")]
PromptTokensOpt = Annotated[int, typer.Option("--n-prompt", "-p", min=16, max=8192, help="Prompt tokens of the "
                                              "prefill measure (bench's pp).")]
GenTokensOpt = Annotated[int, typer.Option("--n-gen", "-n", min=2, max=4096, help="Tokens of the decode measure "
                                           "(bench's tg).")]
RepetitionsOpt = Annotated[int, typer.Option("--repetitions", min=1, max=20, help="Speed runs a candidate (the "
                                             "median is shown).")]
RepoOpt = Annotated[Optional[str], typer.Option(
    "--repo", help="The model's Hugging Face repository, whose listed quants join the table (their sizes; measured "
    "with --download) [default: the repository a Hub model came from].", show_default=False)]
DownloadOpt = Annotated[bool, typer.Option("--download", help="Download the repository's quants that are not here, "
                                           "and measure them.")]
PlotOpt = Annotated[Optional[Path], typer.Option(
    "--plot", help="Also draw KL divergence against decode tok/s, FILE.svg or FILE.png (needs the plot extra).",
    dir_okay=False, show_default=False)]
SaveOpt = Annotated[bool, typer.Option("--save", help="Make the pick what -m MODEL runs (an alias in the config "
                                       "file).")]


@app.command("advise")
def advise(model: ModelOpt = None, make: MakeOpt = None, reference: ReferenceOpt = None, ctx_size: CtxOpt = 4096,
           max_memory: MaxMemoryOpt = None, min_decode: MinDecodeOpt = None, max_kld: MaxKldOpt = 0.05,
           kv_type: KvTypeOpt = "f16", text: TextOpt = None, allow_requantize: RequantizeOpt = False,
           here_only: HereOnlyOpt = False, repo: RepoOpt = None, download: DownloadOpt = False,
           eval_ctx: EvalCtxOpt = 512, n_prompt: PromptTokensOpt = 256, n_gen: GenTokensOpt = 32,
           repetitions: RepetitionsOpt = 3,
           threads: ThreadsOpt = None, save: SaveOpt = False, plot: PlotOpt = None, as_json: JsonOpt = False) -> None:
    """Measure every file of a model found here (and the types --make makes): size, memory at your context, prefill
    and decode tok/s on this machine, KL divergence and top-1 agreement against the reference; mark the front (none
    faster and closer) and pick one under --max-memory, --min-decode and --max-kld, saying why. Figures are kept per
    file: an interrupted advise resumes."""
    from llmcli.cli import output as out
    from llmcli.cli.models_cmd import _aliases
    from llmcli.errors import ExitCode, UsageError
    from llmcli.eval import quality
    from llmcli.eval import quant_advise as qa
    from llmcli.interrupt import Cancellation
    from llmcli.store import catalog
    from llmcli.units import parse_size

    console = out.stderr_console()
    if plot is not None:
        from llmcli.cli.bench import _check_plot

        _check_plot(plot)  # before anything is measured
    kv_types = list(dict.fromkeys(t.strip().lower() for t in kv_type.split(",") if t.strip()))
    if not kv_types or any(t not in ("f16", "q8_0", "q4_0") for t in kv_types):
        raise UsageError(f"--kv-type {kv_type!r}: f16, q8_0 or q4_0, comma-separated")
    try:
        limit = parse_size(max_memory) if max_memory is not None else None
    except ValueError as exc:
        raise UsageError(f"--max-memory: {exc}") from None
    words = quality.read_text(text)
    aliases = _aliases()
    named = model or _default_model()
    if save and (named.startswith(("/", "./", "../", "~")) or named.lower().endswith(".gguf")):
        raise UsageError(f"--save makes the pick what a model's name runs; {named} is a file",
                         hint="Name the model (an alias in the config file, an installed or cached model), or run "
                              "the pick with -m.")
    resolved = catalog.local_model(named, aliases)
    cancel = Cancellation()
    measure = qa.Measure(words, eval_ctx, prompt_tokens=n_prompt, gen_tokens=n_gen, repetitions=repetitions,
                         threads=_threads(threads))
    interrupted = False
    with out.progress_bar("quant advise") as advance:
        def progress(what: str, done: int, total: int) -> None:
            advance(done, total, what)

        candidates = qa.find_candidates(resolved, everywhere=not here_only)
        repo = repo or (resolved.source[3:].split("@", 1)[0] if resolved.source.startswith("hf:") else None)
        if repo is not None:
            from llmcli.config import settings

            timeout = float(settings.resolve({})["hub_timeout"])
            candidates = qa.hub_candidates(repo, candidates, download, timeout, progress)
        try:
            if make:
                with cancel.raising():
                    candidates = qa.make_types(candidates, [t.strip() for t in make.split(",") if t.strip()],
                                               allow_requantize, cancel, progress)
        except KeyboardInterrupt:
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        base = next(c for c in candidates if c.here)
        if reference is not None:
            chosen = catalog.local_model(reference, aliases)
            base = next((c for c in candidates if c.path.resolve() == chosen.path.resolve()), None) or \
                qa.candidate_of(chosen)
        candidates = qa.with_kv_types(candidates, kv_types)
        with cancel.on_signals():
            for candidate in candidates:
                if candidate.here and not qa.measure_candidate(candidate, base, measure, cancel, progress):
                    interrupted = True
                    break
    qa.memory_rows(candidates, ctx_size, limit)
    rows = [c.row() for c in candidates]
    qa.front(rows)
    chosen_row, why = qa.pick(rows, min_decode, max_kld) if not interrupted else (None, "interrupted")
    from llmcli.bench.environment import machine

    where = machine()
    result = {"model": resolved.name, "reference": base.reference, "ctx_size": ctx_size, "kv_types": kv_types,
              "candidates": rows, "pick": chosen_row["name"] if chosen_row else None, "why": why,
              "interrupted": interrupted,
              "machine": {k: where[k] for k in ("cpu", "physical_cores", "llama_cpp_python")}}
    if save and chosen_row is not None and not interrupted:
        from llmcli.config.config_file import save_alias

        own = named.lower()
        save_alias(own, None if chosen_row["model"].lower() == own else chosen_row["model"])
        result["saved"] = f"-m {own} runs {chosen_row['model']}" + (
            f" (add --kv-type {chosen_row['kv_type']}, or set kv_type in the config file)"
            if chosen_row["kv_type"] != "f16" else "")
    if as_json:
        out.print_json(result)
    else:
        _show_advice(result, console)
    if plot is not None and not interrupted:
        from llmcli.bench.plot import plot_advice
        from llmcli.cli.bench import _plotted

        _plotted(plot, plot_advice(result, plot))
    if interrupted:
        raise typer.Exit(ExitCode.INTERRUPTED)


def _threads(given: int | None) -> int | None:
    """-t, else $LLMCLI_THREADS or the config file's `threads`, else None (the cores)."""
    from llmcli.config import settings

    value = settings.resolve({"threads": given})["threads"]
    return int(value) if value else None


def _default_model() -> str:
    from llmcli.config import settings

    value = settings.resolve({})["model"]
    if value:
        return str(value)
    from llmcli.store.packages import packaged_models

    models = packaged_models()
    if not models:
        from llmcli.errors import ModelNotFoundError

        raise ModelNotFoundError("no model given and none installed", hint="Pass -m MODEL.")
    return models[0].short_name


def _show_advice(result: dict[str, Any], console: object) -> None:
    from llmcli.cli import output as out
    from llmcli.units import human_size

    def number(row: dict[str, Any], key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "–"

    rows = [(("* " if r["name"] == result["pick"] else "  ") + r["name"], r["type"], human_size(r["size_bytes"]),
             human_size(r["memory_bytes"]), "yes" if r["fits"] else "no", number(r, "prefill_tokens_per_s", ".1f"),
             number(r, "decode_tokens_per_s", ".1f"), number(r, "kld_mean", ".5f"),
             f"{100 * r['top1_agreement']:.1f}%" if "top1_agreement" in r else "–", "front" if r["pareto"] else "")
            for r in result["candidates"]]
    listed = [r["name"] for r in result["candidates"] if not r["here"]]
    machine = result["machine"]
    out.print_table(("CANDIDATE", "TYPE", "SIZE", f"MEMORY @{result['ctx_size']}", "FITS", "PREFILL T/S",
                     "DECODE T/S", "KLD", "TOP-1", ""), rows,
                    right=("SIZE", f"MEMORY @{result['ctx_size']}", "PREFILL T/S", "DECODE T/S", "KLD", "TOP-1"),
                    title=f"{result['model']} · against {result['reference']} · {machine['cpu']}, "
                          f"{machine['physical_cores']} cores, llama-cpp-python {machine['llama_cpp_python']}")
    if listed:
        print(f"listed on the Hub, not here ({len(listed)}): --download fetches and measures them")
    if result["pick"]:
        print(f"pick: {result['pick']} — {result['why']}")
    else:
        print(f"no pick: {result['why']}")
    if result.get("saved"):
        print(f"saved: {result['saved']}")
