"""bench/sass_loops.py on a listing written here in cuobjdump's format: the loop with HMMA is found
and counted, a loop without HMMA and other functions are passed over, no kernel is an error.
The last line is "N passed, N failed"."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "sass_loops.py")

LISTING = """
\tcode for sm_90a
\t\tFunction : _Z22pr_k_attention_fwd_mmaILi128EEvP13__nv_bfloat16
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R2, R3, R4, R5 ;
        /*0020*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R8, R6, R12 ;
        /*0040*/                   HMMA.16816.F32.BF16 R16, R8, R7, R16 ;
        /*0050*/                   MUFU.EX2 R20, R21 ;
        /*0060*/               @P0 BRA 0x20 ;
        /*0070*/                   ISETP.GE.AND P1, PT, R2, R3, PT ;
        /*0080*/              @!P1 BRA 0x70 ;
        /*0090*/                   EXIT ;
\t\tFunction : _Z9pr_k_ropeP13__nv_bfloat16
        /*0000*/                   IMAD R2, R3, R4, R5 ;
        /*0010*/               @P0 BRA 0x0 ;
"""


def run(text):
    return subprocess.run([sys.executable, SCRIPT], input=text, capture_output=True, text=True)


passed = failed = 0


def check(cond, what):
    global passed, failed
    passed += bool(cond)
    failed += not cond
    if not cond:
        print("FAIL", what)


r = run(LISTING)
check(r.returncode == 0, f"exit {r.returncode}: {r.stderr}")
lines = r.stdout.splitlines()
check(len(lines) == 1 and lines[0].startswith("sm_90a fwd_mma hd 128:"), f"one line for the one mma kernel, named: {lines}")
check("loop 5 instructions, HMMA 2, 2.50 a HMMA" in r.stdout, f"the loop 0x20-0x60: {r.stdout.strip()}")
check("MUFU 1" in r.stdout and "ISETP" not in r.stdout, f"its opcodes only: {r.stdout.strip()}")
r = run(LISTING.split("\t\tFunction : _Z9")[0].replace("HMMA", "FFMA"))
check("no loop with HMMA" in r.stdout, f"a kernel without HMMA in a loop is said so: {r.stdout.strip()}")
r = run("\tcode for sm_90a\n")
check(r.returncode == 1 and "no tensor-core attention kernel" in r.stderr, f"an empty listing fails: {r.returncode} {r.stderr}")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
