"""Import NeMo-RL's per-step training dumps (train_data_step{N}.jsonl) into a prefixreuse trace.

    python3 data/import_nemo_rl.py logs/exp_001/train_data_step12.jsonl -o step12.trace --vocab-size 151936

NeMo-RL's GRPO loop (nemo_rl/algorithms/grpo.py) writes, after each step, the training batch
through Logger.log_batched_dict_as_jsonl (nemo_rl/utils/logger.py): one line per sequence, each
value sliced as the batch's row i (so wrapped in a one-element list), plus "idx". The fields read:

  token_ids            [[T ints]]   prompt and response(s) concatenated, right-padded to the batch's T
  input_lengths        [L]          the sequence's real length (L <= T)
  token_loss_mask      [[T 0/1]]    1 on tokens the policy generated (assistant turns with generation
                                    log-probs), 0 on the prompt, tool/environment turns and padding
  sample_loss_mask     [x]          the sample's loss multiplier (0 = filtered out); optional
  advantages           [[T]]        the sample's advantage, expanded over the sequence
  prev_logprobs        [[T]]        policy log-probs before the update: entry i is the log-prob of token i
                                    (entry 0 is 0); what NeMo-RL's loss uses as the old policy
  generation_logprobs  [[T]]        the generation engine's log-probs, same alignment, 0 on non-generated
  reference_policy_logprobs [[T]]   not in NeMo-RL's dump today; used if every line has it

A sequence's prompt is token_ids[:k], k = the first position with token_loss_mask 1; its suffix is
token_ids[k:L] with loss mask token_loss_mask[k:L] (times sample_loss_mask). Groups are the
sequences with identical prompts, as NeMo-RL's own baseline groups them
(calculate_baseline_and_std_per_prompt). Dumps of NeMo-RL before v0.6.0 hold no token ids and
cannot be imported.

Each input file is one GRPO step's training batch, so the trace is format version 2 with one
optimizer step per input file (its groups); train replays it step by step. With NeMo-RL's
policy.train_global_batch_size below the batch, NeMo-RL steps once per global batch of that many
consecutive rows (BatchedDataDict.shard_by_batch_size, which refuses a batch of another count):
--train-global-batch-size N cuts each file the same way, groups scoped to their step.
"""
import sys

import numpy as np

import primport
from primport import InputError

PER_TOKEN = ("token_ids", "token_loss_mask", "advantages", "prev_logprobs", "generation_logprobs",
             "reference_policy_logprobs")


def _row(where, field, value, per_token):
    """Undo the writer's one-row slice: [[...]] -> [...] for per-token fields, [x] -> x for scalars."""
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], list) or not per_token):
        return value[0]
    if per_token and not isinstance(value, list):
        raise InputError(f"{where}: {field}: must be a list (one row of the batch), got {value!r:.60}")
    return value


def read(path, file_index, args, notes):
    trajs = []
    zero_prev = True        # every prev_logprob of every generated token is exactly 0
    logp_field = "prev_logprobs" if args.logprobs == "prev" else "generation_logprobs"
    records = list(primport.jsonl_records(path))
    gbs = args.train_global_batch_size
    if gbs and len(records) % gbs:     # NeMo-RL's steps: global batch k is rows [k gbs, (k+1) gbs)
        raise InputError(f"{path}: {len(records)} sequences, not a multiple of --train-global-batch-size {gbs} "
                         f"(NeMo-RL's shard_by_batch_size refuses such a batch, so the run had another)")
    for row, (where, rec) in enumerate(records):
        if "token_ids" not in rec and "generation_logprobs" in rec:
            raise InputError(f"{where}: token_ids: missing (dumps of NeMo-RL before v0.6.0 hold no token ids "
                             f"and cannot be imported)")
        ids = _row(where, "token_ids", primport.require(where, rec, "token_ids"), True)
        T = len(ids)
        L = primport.integer(where, "input_lengths",
                             _row(where, "input_lengths", primport.require(where, rec, "input_lengths"), False), 1)
        if L > T:
            raise InputError(f"{where}: input_lengths = {L} exceeds the {T} entries of token_ids")
        ids = primport.tokens(where, "token_ids", ids[:L], args.vocab_size)   # padding is not read

        def per_token(field, kind):
            v = _row(where, field, primport.require(where, rec, field), True)
            if len(v) != T:
                raise InputError(f"{where}: {field}: has {len(v)} entries, token_ids has {T}")
            if kind == "mask":
                return primport.mask(where, field, v[:L], L)
            return primport.reals(where, field, v[:L], L, logp=kind == "logp",
                                  logp_tolerance=args.logp_tolerance)

        tmask = per_token("token_loss_mask", "mask")
        past = [j for j, m in enumerate(_row(where, "token_loss_mask", rec["token_loss_mask"], True)[L:], L) if m]
        if past:       # NeMo-RL pads the mask with 0: a 1 there means input_lengths is wrong
            raise InputError(f"{where}: token_loss_mask[{past[0]}] = 1 lies past input_lengths = {L} (NeMo-RL pads "
                             f"the mask with 0)")
        gen = np.flatnonzero(tmask)
        if gen.size == 0:
            if not args.drop_empty:
                raise InputError(f"{where}: token_loss_mask: no token is marked 1, so the sequence has no "
                                 f"generated response (--drop-empty drops such sequences)")
            k = L
        else:
            k = int(gen[0])
        if k == 0:
            raise InputError(f"{where}: token_loss_mask[0] = 1: the sequence has no prompt tokens before its "
                             f"response")
        smask = 1
        if "sample_loss_mask" in rec:
            sm = _row(where, "sample_loss_mask", rec["sample_loss_mask"], False)
            smask = int(primport.mask(where, "sample_loss_mask", [sm], 1)[0])
        old = per_token(logp_field, "logp")[k:]
        if logp_field == "prev_logprobs" and np.any(old[tmask[k:] == 1] != 0):
            zero_prev = False
        ref = per_token("reference_policy_logprobs", "logp")[k:] if "reference_policy_logprobs" in rec else None
        adv_tok = per_token("advantages", "real")[k:]
        on = adv_tok[tmask[k:] == 1]
        if on.size == 0:
            adv = 0.0
        elif args.varying_advantage == "mean":
            adv = float(on.mean())
        else:
            d = np.flatnonzero(np.abs(on - on[0]) > 1e-6 * max(1.0, abs(on[0])))
            if d.size:
                j = int(k + np.flatnonzero(tmask[k:] == 1)[d[0]])
                raise InputError(f"{where}: advantages[{j}] = {float(adv_tok[j - k])!r} differs from advantages[{k}] = "
                                 f"{float(on[0])!r}: the trace holds one advantage per response "
                                 f"(--varying-advantage mean takes their mean over the trained tokens)")
            adv = float(on[0])
        scope = (file_index, row // gbs) if gbs else file_index
        trajs.append(primport.Traj(where, scope, None, ids[:k], ids[k:], old, ref,
                                   tmask[k:] * np.uint8(smask), advantage=adv))
    extended = prompt_extensions(trajs)
    if extended:
        longer, shorter, n = extended[0]
        notes.append(f"{longer.where}: its prompt is that of {shorter.where} and {n} more tokens"
                     + (f" ({len(extended)} prompts in the file are another's and more)" if len(extended) > 1 else "")
                     + ": a sequence whose first assistant turn is empty has its later turns in its prompt, "
                       "and a group of its own")
    if trajs and logp_field == "prev_logprobs" and zero_prev:
        notes.append(f"{path}: every prev_logprob of a generated token is 0 (the run skipped them, e.g. "
                     f"force_on_policy_ratio): --logprobs generation takes the generation engine's instead")
    return trajs


def prompt_extensions(trajs):
    """(longer, shorter, extra tokens) for each distinct prompt of a step that is another's and more,
    the shorter the longest such. In sorted order a stack holds the chain of prompts, each the one
    below it and more, that the current one may extend."""
    prompts = {}
    for t in trajs:
        prompts.setdefault((t.scope, tuple(t.prompt.tolist())), t)
    found, chain = [], []
    for key in sorted(prompts):
        scope, p = key
        while chain and not (chain[-1][0] == scope and p[:len(chain[-1][1])] == chain[-1][1]):
            chain.pop()
        if chain:
            found.append((prompts[key], prompts[chain[-1]], len(p) - len(chain[-1][1])))
        chain.append(key)
    return found


def main(argv=None):
    p = primport.parser("import_nemo_rl.py", __doc__.split("\n\n")[0] +
                        "\nFields, layout and rules: data/README.md, 'Importing from RL frameworks'.")
    p.add_argument("--logprobs", choices=("prev", "generation"), default="prev",
                   help="old log-probs of the trace: prev_logprobs (the policy before the step, what NeMo-RL's "
                        "loss uses; default) or generation_logprobs (the generation engine's)")
    p.add_argument("--varying-advantage", choices=("error", "mean"), default="error",
                   help="when a response's per-token advantages differ (message-level penalties, token-level "
                        "estimators): an error (default), or their mean over the trained tokens")
    p.add_argument("--train-global-batch-size", type=int, metavar="N",
                   help="NeMo-RL's policy.train_global_batch_size when below the step's batch: each file is then "
                        "one optimizer step per N consecutive sequences (default: one step per file)")
    args = p.parse_args(argv)
    if args.train_global_batch_size is not None and args.train_global_batch_size < 1:
        p.error("--train-global-batch-size must be at least 1")
    notes = []
    return primport.run(args, lambda path, i: read(path, i, args, notes), "token_ids", notes=notes,
                        steps_of=f"global batch of {args.train_global_batch_size} sequences"
                        if args.train_global_batch_size else "input file")


if __name__ == "__main__":
    sys.exit(main())
