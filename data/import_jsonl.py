"""Import rollouts written as minimal JSONL records (one trajectory per line) into a prefixreuse trace.

    python3 data/import_jsonl.py step_0012.jsonl -o step12.trace --vocab-size 151936

For trainers without a dump of their own (verl, OpenRLHF, TRL, your own): write, per trajectory,
one JSON object on one line:

  {"group": "3f2a...", "prompt_ids": [...], "response_ids": [...], "advantage": 0.71,
   "old_logprobs": [...], "ref_logprobs": [...], "loss_mask": [...]}

  group         string or integer: the prompt group's id (verl's uid); null or absent: trajectories
                with identical prompt_ids form a group. Every record has one, or none does.
  prompt_ids    the prompt's token ids, padding removed (>= 1 token); the group's prefix
  response_ids  the sampled response's token ids, padding removed (>= 1 token; an EOS token the
                policy sampled belongs here)
  advantage     one finite number: the advantage applied to every token of the response
  old_logprobs  one per response token: log-prob of response_ids[j] given the prompt and
                response_ids[:j] under the rollout (old) policy; finite, <= 0
  ref_logprobs  optional, same alignment, under the reference policy (every record or none)
  loss_mask     optional, one 0/1 per response token (default all 1): 0 = not trained (tool output)
  meta          optional, anything: ignored (keep your own notes here)

Any other key is an error (it catches a misspelt optional field). data/README.md has the rules
and a recipe for verl, OpenRLHF and TRL.
"""
import sys

import numpy as np

import primport
from primport import InputError

FIELDS = ("group", "prompt_ids", "response_ids", "advantage", "old_logprobs", "ref_logprobs", "loss_mask", "meta")


def read(path, file_index, args):
    trajs = []
    for where, rec in primport.jsonl_records(path):
        unknown = [k for k in rec if k not in FIELDS]
        if unknown:
            raise InputError(f"{where}: {unknown[0]}: unknown field (the fields are {', '.join(FIELDS)})")
        group = rec.get("group")
        if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
            raise InputError(f"{where}: group: must be a string, an integer or null, got {group!r:.60}")
        prompt = primport.tokens(where, "prompt_ids", primport.require(where, rec, "prompt_ids"), args.vocab_size)
        if prompt.shape[0] == 0:
            raise InputError(f"{where}: prompt_ids: empty (the prefix needs at least one token)")
        resp = primport.tokens(where, "response_ids", primport.require(where, rec, "response_ids"),
                               args.vocab_size)
        S = resp.shape[0]
        if S == 0 and not args.drop_empty:
            raise InputError(f"{where}: response_ids: empty (every suffix needs at least one token; "
                             f"--drop-empty drops such records)")
        adv = primport.real(where, "advantage", primport.require(where, rec, "advantage"))
        old = primport.reals(where, "old_logprobs", primport.require(where, rec, "old_logprobs"), S,
                             logp=True, logp_tolerance=args.logp_tolerance)
        ref = rec.get("ref_logprobs")
        if ref is not None:
            ref = primport.reals(where, "ref_logprobs", ref, S, logp=True, logp_tolerance=args.logp_tolerance)
        lm = rec.get("loss_mask")
        lm = np.ones(S, np.uint8) if lm is None else primport.mask(where, "loss_mask", lm, S)
        trajs.append(primport.Traj(where, file_index, group, prompt, resp, old, ref, lm, advantage=adv))
    return trajs


def main(argv=None):
    p = primport.parser("import_jsonl.py", __doc__.split("\n\n")[0] +
                        "\nRecord format and rules: data/README.md, 'Importing from RL frameworks'.")
    args = p.parse_args(argv)
    return primport.run(args, lambda path, i: read(path, i, args), "prompt_ids")


if __name__ == "__main__":
    sys.exit(main())
