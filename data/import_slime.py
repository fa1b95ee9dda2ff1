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
(slime/ray/rollout.py, _post_process_rewards), and this importer does the same. --advantage picks
the estimator's normalisation: grpo (default: (r - mean) / (std + 1e-6), unbiased std), mean
(slime's --disable-grpo-std-normalization) or raw (--disable-rewards-normalization). slime
normalises blocks of n_samples_per_prompt consecutive samples when a rollout holds exactly
n_samples_per_prompt * rollout_batch_size of them, and otherwise the whole rollout as one block:
--n-samples-per-prompt and --rollout-batch-size apply that rule to each file; without them the
file's groups must be consecutive runs of one size, which are slime's blocks for an ordinary
rollout. --normalize-advantages then whitens them over every loss token of the file, as slime's
flag of that name does in training (compute_advantages_and_returns). The file is read without torch
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


def blocks(path, trajs, args):
    """slime's normalisation blocks of one file, as lists of sample positions (rollout.py,
    _post_process_rewards), and a note saying which rule gave them."""
    n = len(trajs)
    if args.n_samples_per_prompt is not None:
        N, B = args.n_samples_per_prompt, args.rollout_batch_size
        if n == N * B:
            return [list(range(i, i + N)) for i in range(0, n, N)], f"{path}: {n} samples = {N} x {B}: blocks of {N}"
        return [list(range(n))], f"{path}: {n} samples, not {N} x {B}: one block of all {n}, as slime does"
    primport.group_trajs(trajs)         # its rule first: every sample has a group id or none has
    runs = []
    for i, t in enumerate(trajs):
        key = t.key if t.key is not None else (t.prompt.shape[0], t.prompt.tobytes())
        if runs and runs[-1][0] == key:
            runs[-1][1].append(i)
        else:
            runs.append((key, [i]))
    sizes = {len(r) for _, r in runs}
    if len(sizes) > 1 or len({k for k, _ in runs}) < len(runs):
        raise InputError(f"{path}: the groups are not consecutive runs of one size, so slime's normalisation "
                         f"blocks depend on its --n-samples-per-prompt and --rollout-batch-size: give both")
    m = sizes.pop()
    return [r for _, r in runs], (f"{path}: {len(runs)} groups of {m} consecutive samples, taken as slime's "
                                  f"n_samples_per_prompt x rollout_batch_size")


def whiten(adv, masks):
    """slime's --normalize-advantages (distributed_masked_whiten): each response's advantage less the
    mean over every loss token, over the square root of their unbiased variance plus 1e-8."""
    w = np.array([float(m.sum()) for m in masks])
    M = w.sum()
    if M == 0:
        raise InputError("--normalize-advantages: no token has loss mask 1, so there is nothing to whiten over")
    mean = (adv * w).sum() / M
    var = (adv * adv * w).sum() / M - mean * mean
    if M >= 2:
        var *= M / (M - 1)
    return (adv - mean) / np.sqrt(var + 1e-8)


def advantages(path, trajs, args, notes):
    """Each trajectory's advantage from the file's rewards, in sample order, as slime computes it."""
    if not trajs:
        return trajs
    r = np.array([t.reward for t in trajs], np.float64)
    a = r.copy()
    if args.advantage != "raw":
        block_list, note = blocks(path, trajs, args)
        notes.append(note)
        for b in block_list:
            x = r[b] - r[b].mean()
            # slime turns the std off at n_samples_per_prompt 1; a block of one is 0 (torch: NaN)
            if args.advantage == "grpo" and args.n_samples_per_prompt != 1 and len(b) > 1:
                x = x / (r[b].std(ddof=1) + args.std_eps)
            a[b] = x
    if args.normalize_advantages:
        a = whiten(a, [t.loss_mask for t in trajs])
    for t, x in zip(trajs, a):
        t.advantage = float(x)
    return trajs


def main(argv=None):
    p = primport.parser("import_slime.py", __doc__.split("\n\n")[0] +
                        "\nFields, layout and rules: data/README.md, 'Importing from RL frameworks'.")
    p.add_argument("--advantage", choices=("grpo", "mean", "raw"), default="grpo",
                   help="advantages from each block's rewards: grpo (r-mean)/(std+eps), mean r-mean, raw r "
                        "(default grpo)")
    p.add_argument("--std-eps", type=float, default=1e-6, metavar="X", help="eps of grpo (default 1e-6, slime's)")
    p.add_argument("--n-samples-per-prompt", type=int, metavar="N", help="slime's, with --rollout-batch-size: "
                   "blocks of N samples when a file holds N x B, else one block (default: the file's groups)")
    p.add_argument("--rollout-batch-size", type=int, metavar="B", help="slime's; see --n-samples-per-prompt")
    p.add_argument("--normalize-advantages", action="store_true",
                   help="whiten the advantages over the file's loss tokens, as slime's flag of that name")
    p.add_argument("--reward-key", metavar="KEY", help="the reward to use when rewards are dicts")
    args = p.parse_args(argv)
    if (args.n_samples_per_prompt is None) != (args.rollout_batch_size is None):
        p.error("--n-samples-per-prompt and --rollout-batch-size go together")
    if args.n_samples_per_prompt is not None and min(args.n_samples_per_prompt, args.rollout_batch_size) < 1:
        p.error("--n-samples-per-prompt and --rollout-batch-size must be at least 1")
    rule = {"grpo": f"(r - mean) / (std + {args.std_eps:g}) over slime's blocks", "mean": "r - mean over slime's blocks",
            "raw": "r"}[args.advantage]
    notes = [f"advantages computed from rewards: {args.advantage}, {rule}"
             + (", then whitened over the loss tokens (--normalize-advantages)" if args.normalize_advantages else "")]
    return primport.run(args, lambda path, i: advantages(path, read(path, i, args), args, notes), "tokens",
                        notes=notes)


if __name__ == "__main__":
    sys.exit(main())
