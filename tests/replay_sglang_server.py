"""A replay server for the SGLang adapter's tests. **It is not SGLang.**

It answers the SGLang 0.5.23 HTTP routes the adapter uses, with the JSON shapes documented in
SGLang's source (``sglang/srt/entrypoints/http_server.py`` for routes and answers,
``sglang/srt/managers/io_struct.py`` for bodies, ``sglang/srt/utils/weight_versions.py`` for
per-token versions), backed by the pure-PyTorch reference engine
(``asyncflow_reference.engines.TorchInferenceEngine``): tokens, log-probs, abort, pause,
sleep and per-token weight versions are real computations, not canned answers.

``/init_weights_update_group`` joins the trainer's group the way SGLang's workers do
(``asyncflow_sglang.group.join_sglang_group``, rank ``rank_offset + 0``: one TP rank), and
``/update_weights_from_distributed`` receives one broadcast per tensor into
``torch.empty(shape, dtype)`` (as ``WeightUpdater.receive_weights_from_distributed``) and
loads them with ``TorchInferenceEngine.load_weights``.

Every request (path, JSON body) is recorded in ``ReplayServer.requests``; ``fault(path, ...)``
injects an HTTP status, a raw (malformed) body or a delay. Body checks are strict where
SGLang's are (``/generate``'s contract check refuses unknown fields; ``top_k`` 0 is refused
by ``SamplingParams.verify``). Run it in its own process with
``python replay_sglang_server.py --port P [--seed S]`` (prints ``READY <url>``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from asyncflow_reference.engines import TorchInferenceEngine
from asyncflow_reference.model import ModelConfig

from asyncflow_core.errors import AsyncFlowError
from asyncflow_core.protocols import GenerationRequest, SamplingParams

SGLANG_VERSION = "0.5.23"
MODEL = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)

# Fields of /generate and of its sampling_params that SGLang's contract check admits
# (sglang/api/v1/api_types.py; a subset: the ones a client may plausibly send).
_GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "rid",
    "lora_path", "return_hidden_states",
}  # fmt: skip
_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "ignore_eos", "skip_special_tokens", "no_stop_trim",
    "sampling_seed", "logit_bias",
}  # fmt: skip


@dataclass
class Fault:
    status: int | None = None
    body: str | None = None
    delay_s: float = 0.0
    times: int = 1


class ReplayServer:
    """``ReplayServer(engine=None, *, version="0.5.23", tp_size=1)``; ``await start()``
    returns the base URL; ``await close()``."""

    def __init__(
        self,
        engine: TorchInferenceEngine | None = None,
        *,
        version: str = SGLANG_VERSION,
        tp_size: int = 1,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        self.engine = engine or TorchInferenceEngine(MODEL, max_batch=8, seed=seed, threads=1)
        self.version = version
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.label = "default"  # SGLang's --weight-version default
        self.requests: list[tuple[str, Any]] = []
        self.faults: dict[str, Fault] = {}
        self.groups: dict[str, Any] = {}
        self.memory_tags: list[Any] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    # ---- control ----------------------------------------------------------------------------
    def fault(
        self,
        path: str,
        *,
        status: int | None = None,
        body: str | None = None,
        delay_s: float = 0.0,
        times: int = 1,
    ) -> None:
        """The next ``times`` calls of ``path`` wait ``delay_s`` then answer ``status`` with
        ``body`` (raw text; default a JSON error), or the real answer when both are None."""
        self.faults[path] = Fault(status, body, delay_s, times)

    def bodies(self, path: str) -> list[Any]:
        return [b for p, b in self.requests if p == path]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(middlewares=[self._middleware])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for path, handler in (
            ("/release_memory_occupation", self.release_memory),
            ("/resume_memory_occupation", self.resume_memory),
            ("/flush_cache", self.flush_cache),
        ):
            r.add_get(path, handler)
            r.add_post(path, handler)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_get("/replay/weights_digest", self.weights_digest)  # test-only, not SGLang
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()
        for pg in self.groups.values():
            torch.distributed.destroy_process_group(pg)
        self.groups.clear()

    # ---- plumbing ---------------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append((request.path, body))
        fault = self.faults.get(request.path)
        if fault is not None and fault.times > 0:
            fault.times -= 1
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status is not None or fault.body is not None:
                return web.Response(
                    status=fault.status or 200,
                    text=fault.body
                    if fault.body is not None
                    else '{"error": {"message": "injected"}}',
                    content_type="application/json",
                )
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except AsyncFlowError as exc:  # SGLang's _create_error_response shape
            return web.json_response({"error": {"message": str(exc)}}, status=400)

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        body = await request.json() if await request.read() else {}
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text='{"error": "body must be an object"}')
        return body

    def _label_of(self, version: int) -> str:
        return self.label if version == self.engine.weight_version else str(version)

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        extra = set(body) - _GENERATE_FIELDS
        sp = body.get("sampling_params") or {}
        extra |= {f"sampling_params.{k}" for k in set(sp) - _SAMPLING_FIELDS}
        if extra:
            return web.json_response({"error": f"unknown fields {sorted(extra)}"}, status=400)
        top_k = sp.get("top_k", -1)
        if top_k != -1 and top_k < 1:
            msg = f"top_k must be -1 (disable) or at least 1, got {top_k}."
            return web.json_response({"error": {"message": msg}}, status=400)
        rid = body.get("rid")
        ids = body.get("input_ids")
        if not isinstance(rid, str) or not isinstance(ids, list):
            return web.json_response({"error": {"message": "need rid and input_ids"}}, status=400)
        params = SamplingParams(
            max_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=0 if top_k == -1 else int(top_k),
            seed=sp.get("sampling_seed"),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
        )
        result = await self.engine.generate(GenerationRequest(rid, tuple(ids), params))
        tokens, lps, versions = list(result.tokens), list(result.logprobs), result.versions
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(versions):
            if spans and spans[-1]["_v"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"_v": v, "version": self._label_of(v), "start": i, "end": i + 1})
        for s in spans:
            del s["_v"]
        reason: dict[str, Any]
        if result.finish_reason == "stop":
            reason = {"type": "stop", "matched": tokens[-1]}
        elif result.finish_reason == "length":
            reason = {"type": "length", "length": len(tokens)}
        else:
            reason = {
                "type": "abort",
                "message": "Abort in waiting queue" if not tokens else "abort",
            }
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": self.label,
            "num_retractions": 0,
            "input_token_logprobs": [[None, t, None] for t in ids],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, tokens, strict=True)],
            "output_token_logprobs_length": len(tokens),
        }
        if spans:
            meta["weight_versions"] = spans
        return web.json_response({"text": "", "output_ids": tokens, "meta_info": meta})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("abort_all"):
            await self.engine.abort(list(self.engine._inflight))
        elif body.get("rid"):
            await self.engine.abort([body["rid"]])
        return web.Response(status=200)  # http_server.py: an empty 200

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"detail": f"bad mode {mode!r}"}, status=422)
        await self.engine.pause("abort" if mode == "abort" else "keep")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request: web.Request) -> web.Response:
        self.memory_tags.append(("release", (await self._json(request)).get("tags")))
        await self.engine.sleep()
        return web.json_response(None)  # the route returns None: FastAPI sends "null"

    async def resume_memory(self, request: web.Request) -> web.Response:
        self.memory_tags.append(("resume", (await self._json(request)).get("tags")))
        await self.engine.wake_up()
        return web.json_response(None)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.running or self.engine.queued:
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.\n")

    # ---- versions and info --------------------------------------------------------------------
    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        new = body.get("new_version")
        if not isinstance(new, str):
            return web.json_response({"detail": "new_version: field required"}, status=422)
        if body.get("abort_all_requests", True):
            await self.engine.abort(list(self.engine._inflight))
        await self._set_label(new)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

    async def _set_label(self, label: str) -> None:
        self.label = label
        if label.isdigit():
            await self.engine.load_weights([], int(label))

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "replay/tiny",
                "served_model_name": "replay/tiny",
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.label,
                "load_format": "auto",
                "model_type": "replay",
                "architectures": ["TransformerLM"],
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "replay/tiny",
                "tp_size": self.tp_size,
                "dp_size": self.dp_size,
                "pp_size": 1,
                "weight_version": "default",
                "internal_states": [{}],
                "version": self.version,
                "frontend": "python",
            }
        )

    # ---- weights ------------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        from asyncflow_sglang.group import join_sglang_group

        body = await self._json(request)
        name = body.get("group_name", "weight_update_group")
        try:
            pg = await asyncio.to_thread(
                join_sglang_group,
                body["master_address"],
                int(body["master_port"]),
                int(body["rank_offset"]) + 0,  # + tp_rank (one TP rank here)
                int(body["world_size"]),
                group_name=name,
                backend=body.get("backend", "nccl"),
                timeout_s=60.0,
            )
        except Exception as exc:
            msg = f"Failed to initialize custom process group: {exc}."
            return web.json_response({"success": False, "message": msg}, status=400)
        self.groups[name] = pg
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.get(name)
        if pg is None:
            msg = f"Group {name} not in {list(self.groups)}."
            return web.json_response({"success": False, "message": msg}, status=400)

        def receive() -> list[tuple[str, torch.Tensor]]:
            out = []
            for n, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                work = torch.distributed.broadcast(t, src=0, group=pg, async_op=True)
                assert work is not None
                work.wait()
                out.append((n, t))
            return out

        weights = await asyncio.to_thread(receive)
        await self.engine.load_weights(weights, self.engine.weight_version)
        if body.get("weight_version") is not None:
            await self._set_label(str(body["weight_version"]))
        return web.json_response(
            {"success": True, "message": "Succeeded to update parameter online."}
        )

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        pg = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            msg = "The group to be destroyed does not exist."
            return web.json_response({"success": False, "message": msg}, status=400)
        torch.distributed.destroy_process_group(pg)
        return web.json_response(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    async def update_from_disk(self, request: web.Request) -> web.Response:
        import safetensors.torch

        body = await self._json(request)
        try:
            weights = list(safetensors.torch.load_file(body["model_path"]).items())
            await self.engine.load_weights(weights, self.engine.weight_version)
        except Exception as exc:
            msg = f"Failed to update weights: {exc}."
            return web.json_response(
                {"success": False, "message": msg, "num_paused_requests": 0}, status=400
            )
        if body.get("weight_version") is not None:
            await self._set_label(str(body["weight_version"]))
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def weights_digest(self, request: web.Request) -> web.Response:
        state = self.engine.model.state_dict()
        return web.json_response(
            {
                n: hashlib.sha256(
                    t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                ).hexdigest()
                for n, t in state.items()
            }
        )


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(
        tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


async def _serve(port: int, seed: int) -> None:
    torch.set_num_threads(1)
    server = ReplayServer(seed=seed)
    url = await server.start(port=port)
    print(f"READY {url}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(_serve(args.port, args.seed))
