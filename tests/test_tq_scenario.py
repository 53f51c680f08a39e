"""The TransferQueue scenario: one script of calls (put a TensorDict batch, get_meta by task
and partition, get_data, a second consumer, a new field written through a meta, status calls,
reset_consumption, force_fetch, a ragged batch, the kv_* calls, clear, checkpoints, bad
inputs) that records what a caller can observe.

``run_scenario(tq, tmp)`` is run here against ``asyncflow_tq`` over the in-process store, with
the expected answers written out (they follow TransferQueue 0.1.11's semantics), and by
``tests/test_ray_tq_diff.py`` against the real ``transfer_queue`` 0.1.11 and the facade, whose
two records it compares.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

tensordict = pytest.importorskip("tensordict", reason="the TransferQueue facade needs [tq]")
from tensordict import TensorDict  # noqa: E402

_BUILTINS = (FileNotFoundError, KeyError, TypeError, ValueError, RuntimeError, Exception)


def describe(value: Any) -> Any:
    """What a caller observes of a value, as plain data (tensors with dtype and layout)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return ("nested", str(value.dtype), [r.tolist() for r in value.unbind()])
        return ("dense", str(value.dtype), list(value.shape), value.tolist())
    if type(value).__name__ in ("NonTensorStack", "LinkedList"):
        return ("nontensor", value.tolist() if hasattr(value, "tolist") else list(value))
    if hasattr(value, "batch_size") and hasattr(value, "keys"):  # a TensorDict
        return {
            "batch_size": list(value.batch_size),
            **{k: describe(value.get(k)) for k in sorted(value.keys())},
        }
    if hasattr(value, "global_indexes") and hasattr(value, "production_status"):  # BatchMeta
        return {
            "global_indexes": list(value.global_indexes),
            "partition_ids": list(value.partition_ids),
            "field_names": list(value.field_names),
            "production_status": [int(x) for x in value.production_status],
            "is_ready": bool(value.is_ready),
            "custom_meta": value.custom_meta,
        }
    if hasattr(value, "keys") and hasattr(value, "tags") and hasattr(value, "partition_id"):
        return {
            "keys": list(value.keys),
            "tags": value.tags,
            "partition_id": value.partition_id,
            "fields": sorted(value.fields) if value.fields is not None else None,
        }
    if isinstance(value, tuple):
        return tuple(describe(v) for v in value)
    if isinstance(value, list):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    return value


class Recorder:
    """Runs each step, recording its observable result, or the error it raised as the
    builtin exception classes it is an instance of."""

    def __init__(self) -> None:
        self.steps: dict[str, Any] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        assert name not in self.steps, name
        try:
            out = fn()
        except Exception as e:
            self.steps[name] = ("error", {c.__name__ for c in _BUILTINS if isinstance(e, c)})
            return None
        self.steps[name] = describe(out)
        return out


def batch(n: int, start: int = 0) -> Any:
    ids = torch.arange(start * 4, (start + n) * 4, dtype=torch.int64).reshape(n, 4)
    return TensorDict(
        {
            "input_ids": ids,
            "scores": torch.arange(start, start + n, dtype=torch.float32) / 2,
            "text": [f"s{i}" for i in range(start, start + n)],
        },
        batch_size=n,
    )


def run_scenario(tq: ModuleType, tmp: Path) -> dict[str, Any]:
    """The script. ``tq`` is initialised with ``controller.polling_mode=True`` (a fetch that
    cannot be served answers an empty BatchMeta at once) and empty."""
    rec = Recorder()
    c = tq.get_client()

    # -- the queue API: put, get_meta by task, get_data --------------------------------------
    rec("put", lambda: c.put(batch(8), partition_id="train"))
    m1 = rec("actor_1", lambda: c.get_meta(["input_ids", "scores"], 3, "train", task_name="actor"))
    rec("actor_1_data", lambda: c.get_data(m1))
    m2 = rec(
        "actor_2",
        lambda: c.get_meta(["input_ids", "scores", "text"], 3, "train", task_name="actor"),
    )
    rec("actor_2_data", lambda: c.get_data(m2))
    rec("actor_3_short", lambda: c.get_meta(["input_ids"], 3, "train", task_name="actor"))
    critic = rec("critic_1", lambda: c.get_meta(["input_ids"], 4, "train", task_name="critic"))
    rec("unknown_field", lambda: c.get_meta(["nope"], 1, "train", task_name="critic"))
    rec("unknown_partition", lambda: c.get_meta(["input_ids"], 1, "nowhere", task_name="critic"))

    # -- a new field written through the meta of samples already there -----------------------
    resp = TensorDict(
        {"response": torch.arange(4 * 2, dtype=torch.float32).reshape(4, 2)}, batch_size=4
    )
    rec("put_response", lambda: c.put(resp, metadata=critic))
    rec("production", lambda: c.get_production_status(["response", "input_ids"], "train"))
    rec("production_unknown", lambda: c.get_production_status(["nope"], "train"))
    rec("check_production_resp", lambda: c.check_production_status(["response"], "train"))
    rec("check_production_ids", lambda: c.check_production_status(["input_ids"], "train"))
    rm = rec("rm_1", lambda: c.get_meta(["response", "input_ids"], 4, "train", task_name="rm"))
    rec("rm_1_data", lambda: c.get_data(rm))

    # -- status, reset, force_fetch -----------------------------------------------------------
    rec("consumption_actor", lambda: c.get_consumption_status("actor", "train"))
    rec("consumption_new_task", lambda: c.get_consumption_status("fresh", "train"))
    rec("consumption_unknown_partition", lambda: c.get_consumption_status("actor", "nowhere"))
    rec("check_consumed_actor", lambda: c.check_consumption_status("actor", "train"))
    rec("reset_actor", lambda: c.reset_consumption("train", "actor"))
    rec("actor_after_reset", lambda: c.get_meta(["input_ids"], 8, "train", task_name="actor"))
    rec("check_consumed_actor_2", lambda: c.check_consumption_status("actor", "train"))
    rec("check_consumed_critic", lambda: c.check_consumption_status("critic", "train"))
    rec("reset_all", lambda: c.reset_consumption("train"))
    rec("consumption_critic_reset", lambda: c.get_consumption_status("critic", "train"))
    rec("force_fetch", lambda: c.get_meta(["response"], 1, "train", mode="force_fetch"))

    # -- ragged rows, several value kinds ------------------------------------------------------
    rows = [torch.arange(n, dtype=torch.float32) for n in (2, 5, 1)]
    ragged = TensorDict(
        {"tokens": torch.nested.nested_tensor(rows, layout=torch.jagged), "tag": ["a", "b", "c"]},
        batch_size=3,
    )
    rec("put_ragged", lambda: c.put(ragged, partition_id="ragged"))
    mr = rec("ragged_meta", lambda: c.get_meta(["tokens", "tag"], 3, "ragged", task_name="t"))
    rec("ragged_data", lambda: c.get_data(mr))
    rec("partitions", lambda: c.get_partition_list())

    # -- the KV API ----------------------------------------------------------------------------
    keys = ["k0", "k1", "k2", "k3"]
    kv = TensorDict({"x": torch.arange(12, dtype=torch.float32).reshape(4, 3)}, batch_size=4)
    tags = [{"score": float(i)} for i in range(4)]
    kvm = rec(
        "kv_batch_put", lambda: tq.kv_batch_put(keys=keys, partition_id="kv", fields=kv, tags=tags)
    )
    rec("kv_get_reordered", lambda: tq.kv_batch_get(keys=["k2", "k0"], partition_id="kv"))
    rec("kv_get_one", lambda: tq.kv_batch_get(keys="k3", partition_id="kv", select_fields="x"))
    rec(
        "kv_put_one",
        lambda: tq.kv_put(
            key="k9", partition_id="kv", fields={"x": torch.ones(3)}, tag={"score": 9.0}
        ),
    )
    rec(
        "kv_tags_only",
        lambda: tq.kv_batch_put(keys=["k0", "k1"], partition_id="kv", tags=[{"v": 1}, {"v": 2}]),
    )
    rec("kv_by_meta", lambda: tq.kv_batch_get_by_meta(kvm))
    rec("kv_by_meta_bad_field", lambda: tq.kv_batch_get_by_meta(kvm, select_fields="nope"))
    rec("kv_list", lambda: tq.kv_list())
    rec("kv_list_one", lambda: tq.kv_list("kv"))
    rec(
        "kv_retrieve_keys",
        lambda: c.kv_retrieve_keys(c.kv_retrieve_meta(["k1", "k3"], "kv").global_indexes, "kv"),
    )
    rec("kv_retrieve_missing", lambda: c.kv_retrieve_meta(["k1", "missing"], "kv"))
    rec("kv_clear", lambda: tq.kv_clear(keys="k1", partition_id="kv"))
    rec("kv_list_after_clear", lambda: tq.kv_list("kv"))
    rec("kv_get_cleared", lambda: tq.kv_batch_get(keys=["k1"], partition_id="kv"))
    rec("kv_new_reuses_index", lambda: tq.kv_put(key="k10", partition_id="kv", tag={"n": 10}))
    rec("kv_new_index", lambda: c.kv_retrieve_meta("k10", "kv").global_indexes)

    # -- clear samples and partitions ----------------------------------------------------------
    first = c.get_meta(["input_ids"], 2, "train", task_name="clearer")
    rec("clear_samples", lambda: c.clear_samples(first))
    rec("consumption_after_clear", lambda: c.get_consumption_status("actor", "train"))
    rec("put_after_clear", lambda: c.put(batch(3, start=20), partition_id="train"))
    rec("clear_partition", lambda: c.clear_partition("ragged"))
    rec("partitions_after_clear", lambda: c.get_partition_list())
    rec("clear_unknown_partition", lambda: c.clear_partition("nowhere"))

    # -- checkpoints ---------------------------------------------------------------------------
    ck = tmp / "ck"
    rec("save", lambda: tq.save_checkpoint(str(ck), metadata={"step": 7}))
    rec(
        "saved_user_metadata",
        lambda: json.loads((ck / "metadata.json").read_text())["user_metadata"],
    )
    rec(
        "kv_clear_all", lambda: tq.kv_clear(keys=["k0", "k2", "k3", "k9", "k10"], partition_id="kv")
    )
    rec("kv_list_emptied", lambda: tq.kv_list("kv"))
    rec("load", lambda: tq.load_checkpoint(str(ck)))
    rec("kv_list_restored", lambda: tq.kv_list("kv"))
    rec("kv_get_restored", lambda: tq.kv_batch_get(keys=["k3", "k0"], partition_id="kv"))
    rec("train_consumption_restored", lambda: c.get_consumption_status("actor", "train"))
    rec("load_missing", lambda: tq.load_checkpoint(str(tmp / "none")))

    # -- bad input: an error, and nothing changed ----------------------------------------------
    before = describe(tq.kv_list())
    rec("bad_kv_get_empty_keys", lambda: tq.kv_batch_get(keys=[], partition_id="kv"))
    rec("bad_kv_get_unknown_key", lambda: tq.kv_batch_get(keys=["nope"], partition_id="kv"))
    rec("bad_kv_get_key_type", lambda: tq.kv_batch_get(keys=[1, 2], partition_id="kv"))
    rec("bad_kv_put_size", lambda: tq.kv_batch_put(keys=["n1", "n2"], partition_id="kv", fields=kv))
    rec("bad_kv_put_nothing", lambda: tq.kv_batch_put(keys=["n1"], partition_id="kv"))
    rec("bad_kv_put_tags", lambda: tq.kv_batch_put(keys=["n1", "n2"], partition_id="kv", tags=[{}]))
    rec(
        "bad_kv_put_nested",
        lambda: tq.kv_put(key="n1", partition_id="kv", fields={"x": ragged["tokens"]}),
    )
    rec("bad_put_no_partition", lambda: c.put(batch(2)))
    rec("bad_retrieve_keys_type", lambda: c.kv_retrieve_keys("zero", "kv"))
    rec("unchanged_after_bad", lambda: describe(tq.kv_list()) == before)
    return rec.steps


# ----------------------------------------------------------------------------------------------
# the facade, in-process store
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def facade() -> Iterator[ModuleType]:
    import asyncflow_tq

    asyncflow_tq.init(
        {"backend": {"storage_backend": "InProcess"}, "controller": {"polling_mode": True}}
    )
    try:
        yield asyncflow_tq
    finally:
        asyncflow_tq.close()


def _err(*names: str) -> tuple[str, set[str]]:
    return ("error", {*names, "Exception"})


def test_scenario_facade_in_process(facade: ModuleType, tmp_path: Path) -> None:
    s = run_scenario(facade, tmp_path)
    # partition "train" pre-allocates index 0 then takes 1..7: one counter for every partition
    assert s["put"]["global_indexes"] == list(range(8))
    assert s["put"]["field_names"] == ["input_ids", "scores", "text"] and s["put"]["is_ready"]
    assert s["actor_1"]["global_indexes"] == [0, 1, 2]
    assert s["actor_1"]["field_names"] == ["input_ids", "scores"]
    ids = s["actor_1_data"]["input_ids"]
    assert ids == ("nested", "torch.int64", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    assert s["actor_1_data"]["scores"] == ("dense", "torch.float32", [3], [0.0, 0.5, 1.0])
    assert s["actor_2"]["global_indexes"] == [3, 4, 5]
    assert s["actor_2_data"]["text"] == ("nontensor", ["s3", "s4", "s5"])
    assert s["actor_3_short"]["global_indexes"] == []  # 2 left < 3: polling mode answers empty
    assert s["critic_1"]["global_indexes"] == [0, 1, 2, 3]  # a task consumes on its own
    assert s["unknown_field"]["global_indexes"] == []
    assert s["unknown_partition"]["global_indexes"] == []
    assert s["put_response"]["field_names"] == ["input_ids", "response"]
    idx, status = s["production"]
    assert idx[3] == list(range(8))
    # columns in the order the fields were first written, whatever the order asked
    assert status[3] == [[1, 1]] * 4 + [[1, 0]] * 4
    assert s["production_unknown"] == (None, None)
    assert s["check_production_resp"] is False and s["check_production_ids"] is True
    assert s["rm_1"]["global_indexes"] == [0, 1, 2, 3]
    assert s["rm_1_data"]["response"][2] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert s["consumption_actor"][1][3] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert s["consumption_new_task"][1][3] == [0] * 8
    assert s["consumption_unknown_partition"] == (None, None)
    assert s["check_consumed_actor"] is False
    assert s["reset_actor"] is True
    assert s["actor_after_reset"]["global_indexes"] == list(range(8))
    assert s["check_consumed_actor_2"] is True and s["check_consumed_critic"] is False
    assert s["consumption_critic_reset"][1][3] == [0] * 8
    assert s["force_fetch"]["global_indexes"] == list(range(8))
    assert s["force_fetch"]["production_status"] == [1] * 4 + [0] * 4
    # "ragged" pre-allocates 8, then takes 9 and 10
    assert s["put_ragged"]["global_indexes"] == [8, 9, 10]
    assert s["ragged_data"]["tokens"] == (
        "nested",
        "torch.float32",
        [[0.0, 1.0], [0, 1, 2, 3, 4], [0.0]],
    )
    assert s["ragged_data"]["tag"] == ("nontensor", ["a", "b", "c"])
    assert s["partitions"] == ["train", "ragged"]
    assert s["kv_batch_put"]["keys"] == ["k0", "k1", "k2", "k3"]
    assert s["kv_batch_put"]["fields"] == ["x"]
    assert s["kv_get_reordered"]["x"][2] == [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]]
    assert s["kv_get_one"]["x"][2] == [[9.0, 10.0, 11.0]]
    assert s["kv_put_one"]["tags"] == [{"score": 9.0}]
    assert s["kv_tags_only"]["tags"] == [{"score": 0.0, "v": 1}, {"score": 1.0, "v": 2}]
    assert s["kv_by_meta"]["batch_size"] == [4]
    assert s["kv_by_meta_bad_field"] == _err("ValueError")
    assert s["kv_list"]["kv"]["k1"] == {"score": 1.0, "v": 2}
    assert s["kv_list"]["train"] == {} and s["kv_list_one"].keys() == {"kv"}
    assert s["kv_retrieve_keys"] == ["k1", "k3"]
    # k0..k3 took 11 (pre-allocated) and 12..14; an unknown key is left out, not an error
    assert s["kv_retrieve_missing"]["global_indexes"] == [12]
    assert "k1" not in s["kv_list_after_clear"]["kv"]
    assert s["kv_get_cleared"] == _err("ValueError")
    # k1's index was freed by kv_clear: the next new key takes it
    assert s["kv_new_index"] == [12]
    assert s["consumption_after_clear"][0][3] == list(range(2, 8))
    assert s["put_after_clear"]["global_indexes"] == [0, 1, 16]
    assert s["partitions_after_clear"] == ["train", "kv"]
    assert s["saved_user_metadata"] == {"step": 7}
    assert s["kv_list_emptied"] == {"kv": {}}
    assert s["kv_list_restored"] == s["kv_list_after_clear"] | {
        "kv": {**s["kv_list_after_clear"]["kv"], "k10": {"n": 10}}
    }
    assert s["kv_get_restored"]["x"][2] == [[9.0, 10.0, 11.0], [0.0, 1.0, 2.0]]
    restored_idx, restored_done = s["train_consumption_restored"]
    assert restored_idx[3] == [*range(8), 16] and restored_done[3] == [0] * 9
    assert s["load_missing"] == _err("FileNotFoundError")
    assert (
        s["bad_kv_get_empty_keys"][0] == "error" and "ValueError" in s["bad_kv_get_empty_keys"][1]
    )
    assert "ValueError" in s["bad_kv_get_unknown_key"][1]
    assert "TypeError" in s["bad_kv_get_key_type"][1]
    assert "ValueError" in s["bad_kv_put_size"][1]
    assert "ValueError" in s["bad_kv_put_nothing"][1]
    assert "ValueError" in s["bad_kv_put_tags"][1]
    assert "ValueError" in s["bad_kv_put_nested"][1]
    assert "ValueError" in s["bad_put_no_partition"][1]
    assert "TypeError" in s["bad_retrieve_keys_type"][1]
    assert s["unchanged_after_bad"] is True
