"""`OnlineEngine` when a step fails (a rank lost mid-stream): every request in flight ends with
one generic error; what failed, with gloo's peer addresses and paths, goes to the log only."""

from __future__ import annotations

import threading

from graphc.runtime import Engine, Request
from graphc.runtime.online import ENGINE_FAILED, OnlineEngine

LOST_PEER = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:27041")


def test_a_lost_rank_reaches_clients_as_one_generic_error_and_the_log_gets_the_details(compiled, caplog):
    engine = Engine(compiled("lora-groups", "export", "small"))

    def lost(bucket, inputs):
        raise RuntimeError(LOST_PEER)

    engine._run = lost
    online = OnlineEngine(engine, max_waiting=4)
    done, results = threading.Event(), []

    def listener(token, result, logprobs):
        if result is not None:
            results.append(result)
            done.set()

    online.submit(Request([3, 1, 4], 4, stop_at_eos=False), listener)
    assert done.wait(60)
    online.stop(60)
    [result] = results
    assert (result.finish_reason, result.error) == ("error", ENGINE_FAILED)
    assert online.state.failure == ENGINE_FAILED
    [logged] = [r for r in caplog.records if r.name == "graphc.runtime.online"]
    assert logged.getMessage() == "the engine stopped: a step failed" and LOST_PEER in str(logged.exc_info[1])
