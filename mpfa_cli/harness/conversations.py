"""The load of a multi-turn workload: conversations whose next turn holds the answer the server gave to the last.

A conversation sends its turns one after another: turn t + 1 is turn t's prompt, the output ids the server
returned for it (SGLang's `/generate` returns them; the other APIs return text, so multi-turn needs `--api sglang`)
and new user tokens (`prefix_workloads.MultiTurn`), sent `think_time_s` after the answer ended. `concurrency`
conversations run at once, a conversation holding its slot while it thinks. A turn that fails ends its
conversation: its later turns are recorded as failed without being sent. Each turn is one `client.run_load` of one
request, so it is timed as every other request is.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from . import client
from .prefix_workloads import MultiTurn
from .records import RequestRecord
from .request_timeouts import Timeouts

NOT_SENT = "not sent: an earlier turn of its conversation failed"


async def run_conversations(
    url: str, workload: MultiTurn, seed: int, run: int, output_len: int, *, concurrency: int, think_time_s: float,
    warmup: int, max_warmup: int, on_prompt: Callable[[int, list[int]], None],
    on_complete: Callable[[RequestRecord], None], timeouts: Timeouts = Timeouts(),
) -> list[RequestRecord]:
    """Every turn of every conversation of run `run` of the plan (`warmup` one-turn warmup conversations first):
    one record per turn, measured ones indexed conversation x turns + turn - 1, warmup ones -1, -2, ...
    `on_prompt(index, prompt)` is called before each request is sent, `on_complete(record)` as each ends."""
    turns = workload.turns

    async def send(index: int, prompt: list[int]) -> tuple[RequestRecord, list[int]]:
        on_prompt(index, prompt)
        answer: list[int] = []

        def done(record: RequestRecord) -> None:
            record.index = index
            on_complete(record)

        is_warmup = index < 0
        records = await client.run_load(
            url, [] if is_warmup else [prompt], output_len, concurrency=1,
            warmup_prompts=[prompt] if is_warmup else (), on_complete=done, timeouts=timeouts,
            on_answer=lambda record, ids: answer.extend(ids))
        return records[0], answer

    async def conversation(number: int, slots: asyncio.Semaphore) -> list[RequestRecord]:
        done: list[RequestRecord] = []
        async with slots:
            history: list[int] = []
            for turn in range(1, turns + 1):
                if turn > 1:
                    await asyncio.sleep(think_time_s)
                prompt = history + workload.user_tokens(seed, run, number, turn, max_warmup)
                record, answer = await send(number * turns + turn - 1, prompt)
                done.append(record)
                if not record.ok:
                    for later in range(turn + 1, turns + 1):
                        done.append(_not_sent(number * turns + later - 1, workload.prompt_len(later, output_len),
                                              output_len))
                        on_complete(done[-1])
                    break
                history = prompt + answer
        return done

    async def first_turn(number: int, slots: asyncio.Semaphore) -> RequestRecord:
        async with slots:
            prompt = workload.user_tokens(seed, run, workload.conversations + number, 1, max_warmup)
            return (await send(-1 - number, prompt))[0]

    warm_slots, slots = asyncio.Semaphore(concurrency), asyncio.Semaphore(concurrency)
    records = list(await asyncio.gather(*(first_turn(i, warm_slots) for i in range(warmup))))
    for done in await asyncio.gather(*(conversation(c, slots) for c in range(workload.conversations))):
        records += done
    return records


def _not_sent(index: int, input_len: int, output_len: int) -> RequestRecord:
    return RequestRecord(index=index, input_len=input_len, max_new_tokens=output_len, dispatch_s=0.0, error=NOT_SENT)
