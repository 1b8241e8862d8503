"""What a JSON-schema constraint costs per generated token (runtime/engine/grammar.py).

Generates a constrained greedy reply once, then replays its tokens r times, alternating two
loops over the same forwards: plain (decode step + sample) and constrained (decode step +
the grammar's mask + masked sample + advance). Both loops feed the reply's tokens whatever
they sampled, so they run exactly the same forwards. Prints the median and mean ms/token of
each (medians resist a busy machine), their ratio, and the mask's own ms/token (mask +
advance alone).

    python tools/grammar_cost.py [-m MODEL] [-n 96] [-r 5] [-t 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

SCHEMA = {"type": "object"}                 # any object: the loosest mask, the longest replies
PROMPT = "Reply in JSON: what is 2+2?"      # its constrained greedy reply runs to -n tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", default=None, help="model (default: the default model)")
    ap.add_argument("-n", type=int, default=96, help="tokens per generation")
    ap.add_argument("-r", type=int, default=5, help="repetitions of each loop")
    ap.add_argument("-t", type=int, default=None, help="threads")
    a = ap.parse_args()
    if a.n < 8 or a.r < 1 or (a.t is not None and a.t < 1):
        sys.exit("error: need -n >= 8, -r >= 1, -t >= 1")
    import kvrun
    from kvrun.engine.sampling import SamplingParams, sample
    m = kvrun.load(a.m, ctx=1024, threads=a.t)
    greedy = SamplingParams(temp=0)
    t0 = time.perf_counter()
    grammar = m.grammars.json_schema(SCHEMA)
    t_compile = time.perf_counter() - t0
    msgs = [{"role": "user", "content": PROMPT}]
    toks = [ev.token_id for ev in m.chat_stream(msgs, a.n, temp=0, json_schema=SCHEMA)
            if ev.token_id is not None]
    prompt = m.tokenizer.encode_parts(m.template.render_parts(msgs))

    def replay(constrained: bool) -> tuple[list[float], list[float]]:
        """Per token: (ms of the whole step, ms of the mask and advance)."""
        m.reset()
        steps, masks = [], []
        with m.engine.exclusive():
            logits = m.engine.prefill(prompt)
            state = grammar.start() if constrained else None
            for tok in toks:
                t0 = time.perf_counter()
                allowed = state.allowed() if state is not None else None
                t_mask = time.perf_counter() - t0
                got = sample(logits, greedy, [], None, allowed)
                if state is not None:
                    assert got == tok, (got, tok)       # the reply, replayed
                    t1 = time.perf_counter()
                    state.accept(tok)
                    t_mask += time.perf_counter() - t1
                if tok not in m.stop_ids:
                    logits = m.engine.decode_step(tok)
                steps.append((time.perf_counter() - t0) * 1e3)
                masks.append(t_mask * 1e3)
        return steps, masks

    plain, cons, mask = [], [], []
    for _ in range(a.r):                    # alternating: both loops see the same load
        plain += replay(False)[0]
        steps, masks = replay(True)
        cons += steps
        mask += masks
    med, mean = statistics.median, statistics.mean
    print(f"model {m.path.name}, vocab {m.cfg.vocab_size}, {len(toks)} tokens x {a.r}, threads "
          f"{a.t or 'default'}; schema compiled in {t_compile * 1e3:.0f} ms (the library's "
          f"tokenizer built first)")
    print("ms/token       median    mean")
    print(f"plain        {med(plain):8.2f} {mean(plain):8.2f}")
    print(f"constrained  {med(cons):8.2f} {mean(cons):8.2f}   ratio of medians "
          f"{med(cons) / med(plain):.3f}")
    print(f"mask alone   {med(mask):8.3f} {mean(mask):8.3f}   (compute + advance)")


if __name__ == "__main__":
    main()
