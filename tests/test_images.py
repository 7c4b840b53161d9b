"""Images: a random-weight projector (tests/gguf_tools.py `write_projector`) beside SmolLM2 makes a model that sees.
Its answers mean nothing; what is checked is the plumbing — a picture changes the first token's logits against none and
against another picture, the same picture gives the same logits twice, its tokens are counted alike by `count`, `run`
and `serve`, a repeated picture is not encoded again, every way in (run, chat, --batch, each protocol of serve) reaches
the model, and every bad picture is refused with one line."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
import zlib
from pathlib import Path

import pytest
from conftest import start_server, stop_server
from gguf_tools import write_projector
from PIL import Image


def _png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    pixels = bytes((seed * 97 + i * 31 + (i // 7) * 13) % 256 for i in range(size[0] * size[1] * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", size, pixels).save(out, "PNG")
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pictures")
    made = {"one.png": _png(1), "two.png": _png(2)}
    cmyk = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 200, 200, 0)).save(cmyk, "JPEG")
    made["cmyk.jpg"] = cmyk.getvalue()
    frames = [Image.new("RGB", (16, 16), (i * 80, 0, 0)) for i in range(3)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:])
    made["animated.gif"] = gif.getvalue()
    made["truncated.png"] = _png(3)[:80]
    made["notes.png"] = b"these are notes, not a picture\n"
    # A 20,000 x 20,000 PNG whose header promises 400 megapixels (a decompression bomb): refused before any pixel.
    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    made["bomb.png"] = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\0" * 60001))
                        + _chunk(b"IEND", b""))
    for name, data in made.items():
        (folder / name).write_bytes(data)
    with (folder / "huge.png").open("wb") as handle:  # past the 20 MiB an image may be: refused before it is read whole
        handle.truncate(21 * 1024 * 1024)
    return {name: folder / name for name in [*made, "huge.png"]}


def _first_logprobs(cli, model: Path, *args: str) -> list[tuple[str, float]]:
    result = cli("run", "-m", str(model), "--temp", "0", "-n", "1", "--json", "--logprobs", "5", *args, "What is this?")
    assert result.code == 0, result.stderr
    record = json.loads(result.stdout)
    return [(top["token"], round(top["logprob"], 4)) for top in record["logprobs"][0]["top_logprobs"]]


def test_a_picture_reaches_the_model(cli, seeing: Path, pictures: dict[str, Path]) -> None:
    one = _first_logprobs(cli, seeing, "--image", str(pictures["one.png"]))
    assert one == _first_logprobs(cli, seeing, "--image", str(pictures["one.png"]))  # the same picture: the same
    assert one != _first_logprobs(cli, seeing, "--image", str(pictures["two.png"]))  # another picture: not
    assert one != _first_logprobs(cli, seeing)  # none: not
    piped = cli("run", "-m", str(seeing), "--temp", "0", "-n", "1", "--json", "--logprobs", "5", "--image", "-",
                "What is this?", input=pictures["one.png"].read_bytes())
    assert piped.code == 0, piped.stderr
    assert [(t["token"], round(t["logprob"], 4)) for t in json.loads(piped.stdout)["logprobs"][0]["top_logprobs"]] == one


def test_image_tokens_are_counted_alike_and_reported(cli, seeing: Path, pictures: dict[str, Path]) -> None:
    image = str(pictures["one.png"])
    counted = cli("count", "--chat", "-m", str(seeing), "--image", image, "What is this?")
    assert counted.code == 0, counted.stderr
    shown = cli("run", "-m", str(seeing), "--show-prompt", "--image", image, "What is this?")
    assert shown.code == 0 and "<__media__>" in shown.stdout
    result = cli("run", "-m", str(seeing), "--temp", "0", "-n", "2", "--json", "--image", image, "What is this?")
    record = json.loads(result.stdout)
    text_only = cli("count", "--chat", "-m", str(seeing), "What is this?")
    assert record["usage"]["prompt_tokens"] == int(counted.stdout) == int(shown.stderr.split()[0])
    assert int(counted.stdout) > int(text_only.stdout) + 8  # the picture's tokens (16 here) and its newline
    timings = record["timings"]
    assert timings["images"] == 1 and timings["images_encoded"] == 1 and timings["image_s"] > 0
    plain = cli("run", "-m", str(seeing), "--temp", "0", "-n", "2", "--image", image, "What is this?")
    assert "1 image (cached)" in plain.stderr  # (the warm server's slot holds the picture's cells from the run above)
    here = cli("run", "-m", str(seeing), "--keep-alive", "0", "--temp", "0", "-n", "2", "--image", image, "What is this?")
    assert "1 image (1 encoded in" in here.stderr


def test_a_picture_asked_about_again_is_not_encoded_again(cli, seeing: Path, pictures: dict[str, Path]) -> None:
    """chat: the second question about the picture reuses its KV cells; /image and a dropped path both attach."""
    one, two = pictures["one.png"], pictures["two.png"]
    script = f"/image {one}\nWhat is it?\nAnd now?\n{two} and this one?\n/history\n"
    result = cli("chat", "-m", str(seeing), "--temp", "0", "-n", "3", input=script)
    assert result.code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "tok/s" in line or "TTFT" in line]
    assert "1 image (1 encoded in" in lines[0]
    assert "1 image (cached)" in lines[1] and "cached" in lines[1].split("prompt")[1]  # its cells kept
    assert "2 images (1 encoded in" in lines[2]  # the new one encoded, the first one's cells kept
    assert f"[image: {one.name}]" in result.stderr and f"[image: {two.name}]" in result.stderr
    assert "1 image attached" in result.stderr


@pytest.mark.parametrize(("name", "says"), [
    ("notes.png", "not an image llmcli reads"), ("truncated.png", "damaged or truncated"),
    ("bomb.png", "more than 50,000,000 pixels, more than an image may have"), ("animated.gif", "an animated image (3 frames)"),
    ("huge.png", "is more than an image may be"), ("missing.png", "cannot read the image"),
])
def test_bad_pictures_are_one_line(cli, seeing: Path, pictures: dict[str, Path], name: str, says: str) -> None:
    path = pictures.get(name, pictures["one.png"].parent / name)
    result = cli("run", "-m", str(seeing), "-n", "1", "--image", str(path), "hi")
    assert result.code == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_what_cannot_see_says_so(cli, smollm2: Path, seeing: Path, gemma3: Path, pictures: dict[str, Path],
                                 tmp_path: Path) -> None:
    cmyk = cli("run", "-m", str(seeing), "-n", "1", "--image", str(pictures["cmyk.jpg"]), "hi")
    assert cmyk.code == 0, cmyk.stderr  # CMYK is converted, not refused
    blind = cli("run", "-m", str(smollm2), "-n", "1", "--image", str(pictures["one.png"]), "hi")
    assert blind.code == 2 and "this model does not see images" in blind.stderr and "--mmproj" in blind.stderr
    other = cli("run", "-m", str(gemma3), "--mmproj", str(seeing.parent / "mmproj-smol-f16.gguf"), "-n", "1", "hi")
    assert other.code == 5 and "writes embeddings of width 576, but gemma3-270m.gguf takes 640" in other.stderr
    not_one = cli("run", "-m", str(seeing), "--mmproj", str(smollm2), "-n", "1", "hi")
    assert not_one.code == 5 and "is not a vision projector" in not_one.stderr
    for shape, words in (({"width": 60, "heads": 8}, "its width (60) is not a multiple of its attention heads (8)"),
                         ({"image_size": 50, "patch": 14}, "its image size (50) is not a multiple of its patch size")):
        odd = tmp_path / f"odd-{len(words)}" / "mmproj-odd.gguf"  # (issue 58: it loaded, then aborted on the picture)
        odd.parent.mkdir()
        write_projector(odd, 576, **shape)
        refused = cli("run", "-m", str(smollm2), "--mmproj", str(odd), "-n", "1", "--image", str(pictures["one.png"]), "hi")
        assert refused.code == 5 and words in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    shown = cli("show", str(seeing))
    assert "yes: mlp projector, 56 px" in shown.stdout
    assert "no (no vision projector found" in cli("show", str(smollm2)).stdout


def test_gemma3_projector_and_batch_records(cli, gemma3: Path, pictures: dict[str, Path], tmp_path: Path) -> None:
    """Gemma 3's projector (pooled, non-causal image tokens) and --batch records with images, relative to the file."""
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "gemma.gguf").symlink_to(gemma3)
    write_projector(folder / "mmproj-gemma-f16.gguf", 640, kind="gemma3")
    (tmp_path / "one.png").write_bytes(pictures["one.png"].read_bytes())
    records = [{"prompt": "A picture of", "images": ["one.png"], "id": "a"}, {"prompt": "A picture of", "id": "b"},
               {"prompt": "A picture of", "images": ["nope.png"]}, {"prompt": "A picture of", "images": "one.png"}]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = cli("run", "-m", str(folder / "gemma.gguf"), "--batch", str(batch), "-n", "2", "--temp", "0", "--raw")
    assert result.code == 0, result.stderr
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert out[0]["id"] == "a" and out[0]["timings"]["images"] == 1 and out[1]["timings"]["images"] == 0
    assert out[0]["usage"]["prompt_tokens"] > out[1]["usage"]["prompt_tokens"]
    assert "cannot read the image" in out[2]["error"] and '"images" must be a list' in out[3]["error"]
    # (--raw with --image through the warm server, the default: it was refused; llmcli serve's own `images` field now)
    alone = cli("run", "-m", str(folder / "gemma.gguf"), "-n", "2", "--temp", "0", "--raw", "--json",
                "--image", str(tmp_path / "one.png"), "A picture of")
    assert alone.code == 0, alone.stderr
    warm = json.loads(alone.stdout)
    assert warm["timings"]["images"] == 1 and len(cli("ps", "--json").stdout.splitlines()) == 1  # (its server)
    assert warm["text"] == out[0]["text"]  # a batch record's answer is a run's (the same path: the warm server)
    here = cli("run", "-m", str(folder / "gemma.gguf"), "--keep-alive", "0", "-n", "2", "--temp", "0", "--raw",
               "--json", "--image", str(tmp_path / "one.png"), "A picture of")
    assert warm["usage"]["prompt_tokens"] == json.loads(here.stdout)["usage"]["prompt_tokens"]  # rendered alike


def test_every_protocol_reaches_the_model(seeing: Path, pictures: dict[str, Path], tmp_path: Path) -> None:
    """The official clients, each sending the picture its protocol's way; a bad picture is each protocol's 400."""
    import anthropic
    import ollama
    import openai

    data = pictures["one.png"].read_bytes()
    b64 = base64.b64encode(data).decode()
    uri = "data:image/png;base64," + b64
    proc, url = start_server(tmp_path, "-m", str(seeing), "--temp", "0")
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="none") as chat, ollama.Client(host=url) as local, \
                anthropic.Anthropic(base_url=url, api_key="none") as claude:  # (closed after: no socket left to the GC)
            text_only = chat.chat.completions.create(model="smol", max_tokens=1, messages=[
                {"role": "user", "content": "What is this?"}]).usage.prompt_tokens
            reply = chat.chat.completions.create(model="smol", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": uri}}]}])
            counts = {"chat": reply.usage.prompt_tokens}
            assert reply.model_extra["timings"]["images"] == 1
            response = chat.responses.create(model="smol", max_output_tokens=16, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": uri}]}])
            counts["responses"] = response.usage.input_tokens
            message = claude.messages.create(
                model="smol", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}])
            counts["anthropic"] = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
            counts["ollama chat"] = local.chat(model="smol", messages=[
                {"role": "user", "content": "What is this?", "images": [data]}], options={"num_predict": 2}).prompt_eval_count
            counts["ollama generate"] = local.generate(model="smol", prompt="What is this?", images=[data],
                                                       options={"num_predict": 2}).prompt_eval_count
            assert all(count > text_only + 8 for count in counts.values()), (text_only, counts)
            with pytest.raises(openai.BadRequestError, match="not an image llmcli reads"):
                chat.chat.completions.create(model="smol", max_tokens=1, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}])
            with pytest.raises(openai.BadRequestError, match="image URLs are not fetched"):
                chat.chat.completions.create(model="smol", max_tokens=1, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}])
            with pytest.raises(anthropic.BadRequestError, match="an animated image"):
                claude.messages.create(
                    model="smol", max_tokens=1, messages=[{"role": "user", "content": [{"type": "image", "source": {
                        "type": "base64", "media_type": "image/gif",
                        "data": base64.b64encode(pictures["animated.gif"].read_bytes()).decode()}}]}])
            with pytest.raises(ollama.ResponseError, match="more than 50,000,000 pixels"):
                local.generate(model="smol", prompt="hi", images=[pictures["bomb.png"].read_bytes()])
    finally:
        stop_server(proc)


def test_the_projector_comes_with_its_model(cli, seeing: Path, smollm2: Path, pictures: dict[str, Path], serve_hub,
                                            tmp_path: Path) -> None:
    """A Hub repository's mmproj is fetched (and checked) with the model; Ollama's projector layer is used in place."""
    projector = seeing.parent / "mmproj-smol-f16.gguf"
    quantized = tmp_path / "mmproj-smol-Q8_0.gguf"
    quantized.write_bytes(b"never fetched: f16 is preferred")
    hub = serve_hub({"someone/SmolVLM-GGUF": {"smol-Q4_K_M.gguf": smollm2, projector.name: projector,
                                              quantized.name: quantized}})
    asked = cli("run", "-m", "someone/SmolVLM-GGUF", "-n", "1", "--image", str(pictures["one.png"]), "hi")
    assert asked.code == 0, asked.stderr
    assert len(hub.requests("GET", "/cdn/")) == 2  # the model and its f16 projector, not the Q8_0 one
    assert "never fetched" not in "".join(p.read_text(errors="replace")[:40] for p in
                                          (tmp_path / "home" / "cache").rglob("mmproj*"))
    listed = {e["name"]: e for e in json.loads(cli("list", "--json").stdout)}
    assert listed["someone/SmolVLM-GGUF:Q4_K_M"]["projector"].endswith(projector.name)
    root = tmp_path / "ollama"
    (root / "blobs").mkdir(parents=True)
    import hashlib

    model_sha, projector_sha = (hashlib.sha256(p.read_bytes()).hexdigest() for p in (smollm2, projector))
    for digest, target in ((model_sha, smollm2), (projector_sha, projector)):
        (root / "blobs" / f"sha256-{digest}").symlink_to(target)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "seer" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + model_sha, "size": smollm2.stat().st_size},
        {"mediaType": "application/vnd.ollama.image.projector", "digest": "sha256:" + projector_sha,
         "size": projector.stat().st_size}]}))
    env = {"OLLAMA_MODELS": str(root)}
    shown = cli("show", "ollama:seer", env=env)
    assert "yes: mlp projector" in shown.stdout and "not used: projector" not in shown.stderr
    assert cli("run", "-m", "ollama:seer", "-n", "1", "--image", str(pictures["one.png"]), "hi", env=env).code == 0


def test_a_warm_run_sends_the_picture_to_its_server(cli, seeing: Path, pictures: dict[str, Path]) -> None:
    """run's default path: the picture goes to the model's warm server as an image_url part; the same greedy answer
    and token counts as in this process, and the second question finds its cells kept."""
    import shutil
    import tempfile

    runtime = {"LLMCLI_RUNTIME_DIR": tempfile.mkdtemp(prefix="llmcli-rt-", dir="/tmp")}
    image = ("--image", str(pictures["one.png"]))
    try:
        ask = ("run", "-m", str(seeing), "--temp", "0", "-n", "8", "--json", *image, "What is this?")
        in_process = json.loads(cli(*ask).stdout)
        cold = cli(*ask, "--keep-alive", "5m", env=runtime)
        assert cold.code == 0, cold.stderr
        record = json.loads(cold.stdout)
        assert record["text"] == in_process["text"] and record["usage"] == in_process["usage"]
        assert record["timings"]["images"] == 1 and record["timings"]["images_encoded"] == 1
        again = cli("run", "-m", str(seeing), "--keep-alive", "5m", "--temp", "0", "-n", "1", *image, "What is this?",
                    env=runtime)
        assert again.code == 0 and again.stderr.startswith("warm") and "1 image (cached)" in again.stderr, again.stderr
    finally:
        cli("stop", env=runtime)
        shutil.rmtree(runtime["LLMCLI_RUNTIME_DIR"], ignore_errors=True)


def _memory_mib(pid: int, field: str) -> int:
    return int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith(field)).split()[1]) // 1024


@pytest.mark.long
def test_large_pictures_are_decoded_within_a_pixel_budget_and_give_their_memory_back(seeing: Path, tmp_path: Path) -> None:
    """Issue 58: eight requests of four 7000 x 7000 PNGs (1 MB each) took a server from 315 MB to 4.1 GB, 3.7 GB kept
    after: each picture was decoded at once, all of them together. Now the pixels decoded at once are bounded
    (MAX_DECODING_PIXELS: one such picture), a full queue refuses before anything is decoded, and the memory a large
    decode took is handed back: four concurrent requests peak at one decode's worth (+1.3 GB unbounded, +0.9 GB with
    two at once) and leave nothing behind. A request's pictures together hold at most MAX_REQUEST_PIXELS (two such)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx2

    buffer = io.BytesIO()
    Image.new("RGB", (7000, 7000), (200, 30, 30)).save(buffer, "PNG")  # (160 KB: 49 million pixels, 147 MB of RGB)
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    proc, url = start_server(tmp_path, "-m", str(seeing), "--temp", "0", "-P", "1", "--queue", "3")
    try:
        body = {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": uri}}]}]}
        before = _memory_mib(proc.pid, "VmRSS")
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # (the peak, from now)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=120), range(4)))
        assert [reply.status_code for reply in replies] == [200] * 4, [reply.text[:200] for reply in replies]
        peak, after = _memory_mib(proc.pid, "VmHWM") - before, _memory_mib(proc.pid, "VmRSS") - before
        assert peak < 750, peak  # one decode at a time (~450 MB in a server), not four
        assert after < 300, after  # the vision encoder, loaded with the first picture (~140 MB); not 3.7 GB kept
        picture = {"type": "image_url", "image_url": {"url": uri}}  # three in one request: past its allowance
        three = {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "And these?"},
                                                                            picture, picture, picture]}]}
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
        ahead = _memory_mib(proc.pid, "VmRSS")
        refused = httpx2.post(f"{url}/v1/chat/completions", json=three, timeout=120)
        assert refused.status_code == 400 and "pixels in all" in refused.json()["error"]["message"], refused.text
        assert "content[3]" in refused.json()["error"]["message"]  # (the third, named)
        assert _memory_mib(proc.pid, "VmHWM") - ahead < 100  # refused from the headers: none of the three decoded
        # (the first two, decoded before the third's header was read, took the server ~450 MB more)
        assert httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200
        full = start_server(tmp_path, "-m", str(seeing), "-P", "1", "--queue", "0")  # a queue of none: the slot only
        try:
            slow = {**body, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 100}
            with ThreadPoolExecutor(2) as pool:
                busy = pool.submit(httpx2.post, f"{full[1]}/v1/chat/completions", json=slow, timeout=120)
                for _ in range(200):  # the slot taken
                    if httpx2.get(f"{full[1]}/health", timeout=10).json().get("busy"):
                        break
                    time.sleep(0.02)
                refused = httpx2.post(f"{full[1]}/v1/chat/completions", json=body, timeout=120)
                assert busy.result().status_code == 200
            assert refused.status_code == 429 and "busy" in refused.text
        finally:
            stop_server(full[0])
    finally:
        stop_server(proc)
