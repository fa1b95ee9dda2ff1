"""Import slime's rollout dumps (--save-debug-rollout-data rollout_{rollout_id}.pt) into a prefixreuse trace.

    python3 data/import_slime.py dumps/rollout_7.pt -o rollout7.trace --vocab-size 151936

slime (slime/observability/rollout_data_utils.py, save_debug_rollout_data) writes
torch.save({"rollout_id": id, "samples": [Sample.to_dict() ...]}); a sample (slime/utils/types.py,
class Sample) is a plain dict. The fields read:

  group_index        int       the prompt group (samples of one prompt share it); None everywhere:
                               group by identical prompt tokens instead
  tokens             [ints]    prompt and response concatenated
  response_length    int       R: the response is tokens[-R:], the prompt tokens[:-R]
  loss_mask          [R 0/1]   over the response only (0 on tool/environment tokens); None = all 1
  rollout_log_probs  [R]       the rollout engine's log-prob of each response token (0.0 on tokens
                               the policy did not generate)
  reward             number, or a dict (--reward-key picks the number, as slime's --reward-key)
  remove_sample      bool      True: slime zeroes the sample's loss mask; so does this importer

The dump holds no advantages: slime computes them when it turns samples into training data
(slime/ray/rollout.py, _post_process_rewards). --advantage picks that computation:
grpo (default: (r - mean) / (std + 1e-6) per group, unbiased std), mean (slime's
--disable-grpo-std-normalization) or raw (--disable-rewards-normalization). slime normalises
blocks of n_samples_per_prompt consecutive samples when the rollout holds exactly
n_samples_per_prompt * rollout_batch_size of them (else the whole rollout as one block); this
importer normalises each group_index group, the same thing for slime's ordinary rollouts. slime's
--normalize-advantages (a whitening over the rollout's loss tokens) is not reproduced. The file is read without torch
(data/ptfile.py); no code from it is run.
"""
import sys

import numpy as np

import primport
from primport import InputError
from ptfile import PtError, load_pt


def read(path, file_index, args):
    try:
        obj = load_pt(path)
    except PtError as e:
        raise InputError(str(e)) from None
    if not isinstance(obj, dict) or "samples" not in obj:
        got = sorted(map(str, obj.keys())) if isinstance(obj, dict) else type(obj).__name__
        raise InputError(f"{path}: expected slime's {{'rollout_id', 'samples'}} dict, got {got}")
    samples = obj["samples"]
    if not isinstance(samples, (list, tuple)):
        raise InputError(f"{path}: samples: must be a list of sample dicts, got {type(samples).__name__}")
    trajs = []
    for k, s in enumerate(samples):
        where = f"{path}: samples[{k}]"
        if not isinstance(s, dict):
            raise InputError(f"{where}: must be a dict (Sample.to_dict()), got {type(s).__name__}")
        tok = primport.tokens(where, "tokens", primport.require(where, s, "tokens"), args.vocab_size)
        R = primport.integer(where, "response_length", primport.require(where, s, "response_length"), 0)
        if R == 0 and not args.drop_empty:
            raise InputError(f"{where}: response_length = 0: an empty response (--drop-empty drops such samples)")
        if R >= tok.shape[0]:
            raise InputError(f"{where}: response_length = {R} leaves no prompt among the {tok.shape[0]} tokens")
        lm = s.get("loss_mask")
        lm = np.ones(R, np.uint8) if lm is None else primport.mask(where, "loss_mask", lm, R)
        if s.get("remove_sample"):
            lm = np.zeros(R, np.uint8)
        lp = primport.require(where, s, "rollout_log_probs")
        if lp is None:
            raise InputError(f"{where}: rollout_log_probs: None (the rollout returned no log-probs)")
        lp = primport.reals(where, "rollout_log_probs", lp, R, logp=True, logp_tolerance=args.logp_tolerance)
        reward = primport.require(where, s, "reward")
        if isinstance(reward, dict):
            if args.reward_key is None:
                raise InputError(f"{where}: reward: a dict with keys {sorted(map(str, reward))}; "
                                 f"--reward-key names the one to use")
            if args.reward_key not in reward:
                raise InputError(f"{where}: reward[{args.reward_key!r}]: missing (keys: {sorted(map(str, reward))})")
            reward = primport.real(where, f"reward[{args.reward_key!r}]", reward[args.reward_key])
        else:
            reward = primport.real(where, "reward", reward)
        gi = s.get("group_index")
        if gi is not None:
            gi = primport.integer(where, "group_index", gi)
        split = tok.shape[0] - R
        trajs.append(primport.Traj(where, file_index, gi, tok[:split], tok[split:], lp, None, lm, reward=reward))
    return trajs


def main(argv=None):
    p = primport.parser("import_slime.py", __doc__.split("\n\n")[0] +
                        "\nFields, layout and rules: data/README.md, 'Importing from RL frameworks'.")
    p.add_argument("--advantage", choices=("grpo", "mean", "raw"), default="grpo",
                   help="advantages from each group's rewards: grpo (r-mean)/(std+eps), mean r-mean, raw r "
                        "(default grpo)")
    p.add_argument("--std-eps", type=float, default=1e-6, metavar="X", help="eps of grpo (default 1e-6, slime's)")
    p.add_argument("--reward-key", metavar="KEY", help="the reward to use when rewards are dicts")
    args = p.parse_args(argv)
    note = (f"advantages computed from rewards per group: {args.advantage}"
            + (f" (r - mean) / (std + {args.std_eps:g})" if args.advantage == "grpo" else ""))
    return primport.run(args, lambda path, i: read(path, i, args), "tokens", advantage_mode=args.advantage,
                        eps=args.std_eps, notes=[note])


if __name__ == "__main__":
    sys.exit(main())
