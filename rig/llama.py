"""A real mainline llama.cpp ``llama-server`` for ``make test-real`` and ``sluice bench ... --engines``, built from a registry
package and cached.

PyPI's ``llama-cpp-python`` sdist vendors mainline llama.cpp under ``vendor/llama.cpp`` (with its vocab-only GGUF files and
``gguf-py``). ``build()`` downloads that sdist once with pip (the only network use, from the package registry), checks its
sha256 before unpacking, builds only the ``llama-server`` target with cmake (CPU only, portable: ``GGML_NATIVE=OFF``; no
curl, no OpenSSL, no web UI download, no tests or examples) at ``nice -n 19`` with 2 jobs, and writes a tiny random-weight
llama-architecture model (seeded, so every build writes the same bytes) with the vendored ``gguf-py`` and the vendored
``ggml-vocab-llama-spm.gguf`` tokenizer. It answers gibberish, quickly.

Cache: ``${XDG_CACHE_HOME:-~/.cache}/sluice/llama.cpp/<sdist version>/`` holding ``bin/llama-server``, ``tiny-llama.gguf``,
``gguf-py/`` and ``vocab.gguf`` (to rewrite the model without the sources) and ``build.json`` (what was built, how long it
took). Nothing else is kept: the sources and the build tree are removed after a build.

    python -m rig.llama build [--force]   # build unless cached; prints the build time
    python -m rig.llama status            # cached or not, and where
    python -m rig.llama serve --port 8201 [--threads 1] [--parallel 2] [--ctx 4096]

The sdist pins llama.cpp commit ``0c1e57098``, release ``b11312``; the sdist carries no git history, so the build number
and commit are given to cmake explicitly and ``/props`` reports ``build_info`` ``b11312-0c1e57098`` as a release build
would (without them it would say ``b0-unknown``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

SDIST_PACKAGE = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_COMMIT = "0c1e57098"
LLAMA_BUILD_NUMBER = 11312
BUILD_INFO = f"b{LLAMA_BUILD_NUMBER}-{LLAMA_COMMIT}"
VOCAB = "ggml-vocab-llama-spm.gguf"
MODEL_ID = "tiny-llama"
"""The model id the servers are started with (``--alias``); also the GGUF file's stem."""

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else cmake downloads the web UI from Hugging Face
    f"-DLLAMA_BUILD_NUMBER={LLAMA_BUILD_NUMBER}",
    f"-DLLAMA_BUILD_COMMIT={LLAMA_COMMIT}",
)

# The tiny model: llama architecture, random weights (seeded), the vocab's 32,000 tokens.
MODEL_DIMS = {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_head_kv": 2, "n_ff": 384, "n_ctx_train": 4096}
MODEL_SEED = 15


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "llama.cpp" / SDIST_VERSION


def server_binary() -> Path:
    return cache_dir() / "bin" / "llama-server"


def model_file() -> Path:
    return cache_dir() / f"{MODEL_ID}.gguf"


def is_built() -> bool:
    return server_binary().is_file() and os.access(server_binary(), os.X_OK) and model_file().is_file()


def _log(message: str) -> None:
    print(f"[llama-build] {message}", flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download_sdist(into: Path) -> Path:
    """The pinned sdist from the package registry (pip honours the user's index configuration), hash checked."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                    f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(into)], check=True)
    sdist = into / SDIST_FILE
    got = sha256_of(sdist)
    if got != SDIST_SHA256:
        raise RuntimeError(f"{SDIST_FILE}: sha256 {got} is not the pinned {SDIST_SHA256}; refusing to unpack it")
    return sdist


def _unpack_llama(sdist: Path, into: Path) -> Path:
    """Only ``vendor/llama.cpp`` of the sdist, under ``into``."""
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(into, members=members, filter="data")
    return into / prefix.rstrip("/")


def build(force: bool = False) -> dict[str, object]:
    """Build ``llama-server`` and write the tiny model unless both are cached. Returns what ``build.json`` records."""
    with _lock():
        if is_built() and not force:
            cached: dict[str, object] = json.loads((cache_dir() / "build.json").read_text())
            return cached
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir()))
        try:
            _log(f"downloading {SDIST_PACKAGE}=={SDIST_VERSION} (sdist) from the package registry")
            sdist = _download_sdist(work)
            downloaded = time.monotonic()
            _log(f"sha256 {SDIST_SHA256} verified ({downloaded - started:.0f} s); unpacking vendor/llama.cpp")
            source = _unpack_llama(sdist, work / "src")
            sdist.unlink()
            build_dir = work / "build"
            nice = ["nice", "-n", "19"]
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            _log("cmake configure: " + " ".join(CMAKE_FLAGS))
            subprocess.run([*nice, "cmake", "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_FLAGS],
                           check=True, stdout=subprocess.DEVNULL)
            _log("building llama-server (nice -n 19, 2 jobs; about 15 minutes on 2 cores)")
            subprocess.run([*nice, "cmake", "--build", str(build_dir), "--target", "llama-server", "-j", "2"],
                           check=True, stdout=subprocess.DEVNULL)
            compiled = time.monotonic()
            (cache_dir() / "bin").mkdir(exist_ok=True)
            shutil.copy2(build_dir / "bin" / "llama-server", server_binary())
            shutil.rmtree(cache_dir() / "gguf-py", ignore_errors=True)
            shutil.copytree(source / "gguf-py" / "gguf", cache_dir() / "gguf-py" / "gguf")
            shutil.copy2(source / "gguf-py" / "LICENSE", cache_dir() / "gguf-py" / "LICENSE")
            shutil.copy2(source / "models" / VOCAB, cache_dir() / "vocab.gguf")
            write_model_subprocess()
            record = {
                "sdist": f"{SDIST_PACKAGE}=={SDIST_VERSION}", "sdist_sha256": SDIST_SHA256, "build_info": BUILD_INFO,
                "cmake_flags": list(CMAKE_FLAGS), "model": MODEL_DIMS | {"seed": MODEL_SEED, "vocab": VOCAB},
                "download_seconds": round(downloaded - started, 1), "build_seconds": round(compiled - downloaded, 1),
                "total_seconds": round(time.monotonic() - started, 1),
                "built_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            }
            (cache_dir() / "build.json").write_text(json.dumps(record, indent=2) + "\n")
            _log(f"built {server_binary()} in {record['build_seconds']:.0f} s (download {record['download_seconds']:.0f} s, "
                 f"total {record['total_seconds']:.0f} s); model {model_file()}")
            return record
        finally:
            shutil.rmtree(work, ignore_errors=True)


def write_model_subprocess() -> None:
    """Write the tiny model with the cached vendored ``gguf-py`` (in a child, so ``gguf`` never enters this process)."""
    source = str(Path(__file__).resolve().parents[1])  # this source tree, for ``-m rig.llama`` from any directory
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(cache_dir() / "gguf-py"), source,
                                                                    os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "rig.llama", "write-model"], check=True, env=env)


def write_model(out: Path, vocab: Path, seed: int = MODEL_SEED, **dims: int) -> None:
    """A random-weight llama model with ``vocab``'s tokenizer: deterministic for a seed (the writer adds no timestamps)."""
    import numpy as np
    import gguf  # the vendored gguf-py, on PYTHONPATH

    d = MODEL_DIMS | dims
    n_embd, n_layer, n_head, n_head_kv, n_ff = d["n_embd"], d["n_layer"], d["n_head"], d["n_head_kv"], d["n_ff"]
    head = n_embd // n_head
    reader = gguf.GGUFReader(vocab)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(MODEL_ID)
    writer.add_context_length(d["n_ctx_train"])
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        values: np.ndarray = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        return values

    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(head * n_head_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(head * n_head_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weight(n_vocab, n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)


def server_command(port: int, *, threads: int = 1, parallel: int = 2, ctx: int = 4096, alias: str = MODEL_ID,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """``llama-server`` as the tests and benchmarks run it: ``parallel`` slots sharing ``ctx`` tokens of context (each slot
    ``ctx / parallel``), Prometheus ``/metrics`` and ``/slots`` on."""
    return [str(server_binary()), "--model", str(model_file()), "--alias", alias, "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(parallel),
            "--ctx-size", str(ctx), "--metrics", "--slots", "--no-webui", *extra]


def wait_healthy(url: str, process: subprocess.Popen[bytes] | None = None, timeout: float = 60.0) -> None:
    """Until ``/health`` answers 200 (llama-server answers 503 while it loads the model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode} before it was healthy")
        with contextlib.suppress(Exception), urllib.request.urlopen(url + "/health", timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"llama-server at {url} not healthy within {timeout:g} s")


def start_server(port: int, log_path: Path, *, threads: int = 1, parallel: int = 2, ctx: int = 4096,
                 alias: str = MODEL_ID, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """Start ``llama-server`` on ``port`` (its log to ``log_path``; the rest as ``server_command``) and wait until it is
    healthy."""
    out = log_path.open("ab")
    command = server_command(port, threads=threads, parallel=parallel, ctx=ctx, alias=alias, extra=extra)
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rig.llama", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("build", help="build llama-server and the tiny model unless cached")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    sub.add_parser("status", help="say whether the cache holds a built server, and where")
    sub.add_parser("write-model", help="(internal) write the tiny model with the cached gguf-py")
    p = sub.add_parser("serve", help="run the cached llama-server in the foreground")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.verb == "build":
        record = build(force=args.force)
        _log(f"ready: {server_binary()} ({record['build_info']}), built in {record['build_seconds']} s "
             f"on {record['built_at']}")
        return 0
    if args.verb == "status":
        print(f"{'built' if is_built() else 'absent'}: {cache_dir()}")
        return 0 if is_built() else 1
    if args.verb == "write-model":
        write_model(model_file(), cache_dir() / "vocab.gguf")
        return 0
    if not is_built():
        parser.error("llama-server is not built: run `python -m rig.llama build` (or `make test-real`)")
    os.execv(str(server_binary()), server_command(args.port, threads=args.threads, parallel=args.parallel, ctx=args.ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
