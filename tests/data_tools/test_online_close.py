"""Closing the online source while its producer is inside an engine call: the call is
interrupted through the queue vLLM's client waits on, not waited for (at long sequences one call
is minutes of engine time whose sequences would be thrown away)."""

import logging
import queue
import threading
import time
from types import SimpleNamespace

from data_tools.online import VllmSource
from dspark.formats.stream import BlockProducer, StreamClosed, StreamMeta
from dspark.serving.vllm_engine import interrupt_generate


class EndlessEngine:
    """A stand-in for ``vllm.LLM`` with vLLM 0.32's multiprocess client: ``generate`` waits on
    ``llm_engine.engine_core.outputs_queue`` and raises an exception found there, as
    ``SyncMPClient.get_output`` does; no output ever comes."""

    def __init__(self):
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue.Queue()))
        self.calls = 0

    def generate(self):
        self.calls += 1
        item = self.llm_engine.engine_core.outputs_queue.get()
        raise item


def test_interrupt_generate_hands_the_error_to_the_waiting_call():
    llm, got = EndlessEngine(), []

    def call():
        try:
            llm.generate()
        except StreamClosed as e:
            got.append(e)

    t = threading.Thread(target=call)
    t.start()
    assert interrupt_generate(llm, StreamClosed("stop"))
    t.join(5)
    assert not t.is_alive() and [str(e) for e in got] == ["stop"]
    assert not interrupt_generate(SimpleNamespace(), StreamClosed("x"))  # an in-process engine: nothing to do


def test_close_interrupts_the_producers_engine_call_and_returns_at_once(tmp_path, caplog):
    src = VllmSource.__new__(VllmSource)  # the engine-free parts: the producer loop and close
    BlockProducer.__init__(src, block=2, buffer_size=2, poll_s=0.01)
    src.llm, src.work = EndlessEngine(), tmp_path / "work"
    src.meta = StreamMeta([1, 2], 8, "float32", num_prompts=4, max_seq_len=64)
    src.train_prompts, src.skipped = [None] * 4, {}
    src._capture = lambda indexes, convs: src.llm.generate()
    src.work.mkdir()
    src.start(0)
    while src.llm.calls == 0:
        time.sleep(0.01)
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="data_tools.online"):
        src.close()
    assert time.perf_counter() - t0 < 5  # not the 600 s bound of a call that never ends
    assert src._thread is None and not src.work.exists()
    assert "interrupted the producer's engine call" in caplog.text
    assert src.buffer._error is None  # a clean stop, not an error handed to the trainer
