"""Bytes of the pickled step message a decode step sends to parallel ranks (a
`SchedulerOutput`, as `oxserve.parallel` broadcasts it), at 1, 8 and 32 decoding requests
with 37-character request ids: the figures behind `MESSAGE_BYTES` in
`oxserve/parallel/cost_model.py`.

    python docs/bench/step_message_bytes.py
"""

from __future__ import annotations

import pickle

from oxserve import LLM, SamplingParams


def message_bytes(requests: int) -> int:
    llm = LLM(dtype="bfloat16", threads=2)
    engine, sizes = llm.engine, []
    execute = engine.runner.execute

    def measured(scheduled):
        if len(scheduled.scheduled) == requests and all(s.is_decode for s in scheduled.scheduled):
            sizes.append(len(pickle.dumps(scheduled)))
        return execute(scheduled)

    engine.runner.execute = measured
    for i in range(requests):
        engine.add_request(f"cmpl-{i:032x}", list(range(40 + i, 140 + i)), SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    llm.close()
    return sorted(sizes)[len(sizes) // 2]


if __name__ == "__main__":
    print({requests: message_bytes(requests) for requests in (1, 8, 32)})
