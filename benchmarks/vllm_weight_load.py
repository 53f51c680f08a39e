"""How fast weights reach a real vLLM on a CPU: ``load_weights`` through the worker extension,
in process (``VLLMEngine``, vLLM's msgpack link) and over HTTP (``VLLMHTTPEngine``,
``/collective_rpc``), against a memcpy of the same bytes in the same run.

Run it in the vLLM environment (``make vllm-venv``)::

    .venv-vllm/bin/python benchmarks/vllm_weight_load.py [--width 768] [--layers 4] [--rounds 3]

A random Qwen2 of the given shape is written to a temporary folder and served twice (an
in-process ``AsyncLLM`` and a ``vllm serve`` on 127.0.0.1); each round loads the model's own
tensors (HF names, as a trainer exports them) once per path and piece size, interleaved. For
each load: seconds in all, of them the workers' reload (``reload_weights``: the loaders' copy
and the CPU GEMM re-packing), tensor bytes/s, and the transfer's time in memcpys of the same
bytes (``(seconds - reload) / memcpy seconds``: the copies and framing along the link, an
equivalent count, not a trace). The last stdout line is JSON with every measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch


def make_model(folder: Path, width: int, layers: int) -> None:
    import transformers
    from asyncflow_hf.assets import build_tokenizer

    tok = build_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=width, intermediate_size=width * 3,
        num_hidden_layers=layers, num_attention_heads=width // 64, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


def memcpy_s(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def start_server(folder: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "asyncflow_vllm.worker_ext.WeightUpdateExtension",
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env
    )


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"vllm serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/version", timeout=5):
                return
        except OSError:
            time.sleep(0.5)  # polling for the server's answer
    sys.exit("vllm serve did not start")


async def measure(engine: Any, weights: list[tuple[str, torch.Tensor]], version: int) -> Any:
    t0 = time.perf_counter()
    await engine.load_weights(weights, version)
    seconds = time.perf_counter() - t0
    report = engine.last_load
    return seconds, report.load_s, report.calls


async def main_async(args: argparse.Namespace) -> None:
    import signal

    from asyncflow_vllm import VLLMEngine, VLLMHTTPEngine
    from safetensors.torch import load_file

    from asyncflow_core.engines.process import free_port

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        make_model(folder, args.width, args.layers)
        weights = sorted(load_file(str(folder / "model.safetensors")).items())
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        port = free_port()
        server = start_server(folder, port, Path(tmp) / "server.log")
        try:
            local = await VLLMEngine.create(str(folder), dtype="float32", enforce_eager=True)
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, server)
            remote = VLLMHTTPEngine(url)
            await remote.connect()
            paths = [("in process", local, p) for p in args.local_pieces]
            paths += [("http", remote, p) for p in args.http_pieces]
            rows: list[dict[str, Any]] = []
            version = 0
            print(f"load average {os.getloadavg()[0]:.2f}; {len(weights)} tensors, "
                  f"{nbytes / 1e6:.1f} MB", flush=True)  # fmt: skip
            for round_ in range(args.rounds):
                copy_s = memcpy_s(nbytes)
                for name, engine, piece in paths:
                    engine.piece_bytes = piece
                    version += 1
                    seconds, load_s, calls = await measure(engine, weights, version)
                    rows.append({
                        "round": round_, "path": name, "piece_mib": piece / (1 << 20),
                        "calls": calls, "seconds": round(seconds, 4), "reload_s": round(load_s, 4),
                        "mb_per_s": round(nbytes / seconds / 1e6, 1),
                        "transfer_in_memcpys": round((seconds - load_s) / copy_s, 1),
                        "memcpy_s": round(copy_s, 5), "load": round(os.getloadavg()[0], 2),
                    })  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
            await remote.close()
            await local.close()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    print(f"\n{'path':<10} {'piece MiB':>9} {'calls':>5} {'s':>7} {'reload s':>8} "
          f"{'MB/s':>7} {'memcpys':>7}")  # fmt: skip
    keys = sorted({(r["path"], r["piece_mib"]) for r in rows})
    summary = []
    for path, piece in keys:
        mine = [r for r in rows if (r["path"], r["piece_mib"]) == (path, piece)]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("seconds", "reload_s", "mb_per_s", "transfer_in_memcpys")}  # fmt: skip
        summary.append({"path": path, "piece_mib": piece, "calls": mine[0]["calls"], **med})
        print(f"{path:<10} {piece:>9.0f} {mine[0]['calls']:>5} {med['seconds']:>7.3f} "
              f"{med['reload_s']:>8.3f} {med['mb_per_s']:>7.1f} "
              f"{med['transfer_in_memcpys']:>7.1f}")  # fmt: skip
    print(json.dumps({"bytes": nbytes, "tensors": len(weights), "width": args.width,
                      "layers": args.layers, "medians": summary, "runs": rows}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    pieces = [8 << 20, 16 << 20, 256 << 20]
    parser.add_argument("--local-pieces", type=int, nargs="+", default=pieces)
    parser.add_argument("--http-pieces", type=int, nargs="+", default=[16 << 20])
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
