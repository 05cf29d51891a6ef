#!/bin/sh
# test_mpi.sh - tests of the tensor-parallel tiny_llama (tl_mpi.c) on 2 ranks against
# 1 rank. Run by `make test-mpi` from the repository root. Skipped, with a SKIP line,
# only where mpicc or mpirun is missing or mpirun cannot start 2 processes.
#
#   1. full attention, a random GQA model (8 query heads, 4 KV heads, 2 per rank):
#      the 2-rank logits equal the 1-rank logits within 1e-4 at every decode step
#      (see README, "Serving at scale": the partial sums are reduced in double, so
#      the fp32 residuals differ at most by a rare last-bit rounding); and they
#      equal tiny_llama.h's own tl_forward over the same tokens within 1e-4
#   2. oracle attention (exact per-head top-k), same model: every KV head selects
#      the same tokens at every step and layer on 2 ranks as on 1
#   3. pqcache with a budget of everything (-b 1) on 2 ranks: logits and selections
#      those of full attention on 1 rank
#   4. pqcache on the passkey model (widened to 2 KV heads) at 2K: the passkey is
#      retrieved on 1 and on 2 ranks; every KV head of the 2-rank run selects at
#      every step and layer the tokens the same head selected in the 1-rank run
#      (each rank's cache is seeded by the model's head index: first_kv_head; the
#      split is the fixed one whose window competes: PQC_SPLIT_FIXED_COMPETE)
#   5. the passkey at 8K on 2 ranks: retrieved
#   6. errors: more ranks than KV heads, a truncated checkpoint, a bad option give a
#      message and a non-zero exit, not a crash
set -u
MAKE=${MAKE:-make}
MPICC=${MPICC:-mpicc}
MPIRUN=${MPIRUN:-mpirun}
MPIRUN_FLAGS=${MPIRUN_FLAGS:---oversubscribe --bind-to none}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=build/mpi_test
pass=0
fail=0

skip() {
    echo "SKIP test-mpi: MPI cannot start ($1)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
}
command -v "$MPICC" >/dev/null 2>&1 || skip "$MPICC not found"
command -v "$MPIRUN" >/dev/null 2>&1 || skip "$MPIRUN not found"
# shellcheck disable=SC2086
$MPIRUN $MPIRUN_FLAGS -np 2 true >/dev/null 2>&1 || skip "$MPIRUN -np 2 true failed"

$MAKE --no-print-directory build/tiny_llama_mpi build/tiny_llama_gen build/make_passkey \
    build/passkey_hard.bin >/dev/null || { echo "FAIL test-mpi: build"; echo "0 passed, 1 failed"; exit 1; }
mkdir -p $B

ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; [ -f "$2" ] && sed 's/^/     | /' "$2"; }
# run NP LOG ARGS...: the engine on NP ranks, its output in LOG; the exit status
run() {
    np=$1; log=$2; shift 2
    # shellcheck disable=SC2086
    $MPIRUN $MPIRUN_FLAGS -np "$np" build/tiny_llama_mpi "$@" >"$log" 2>&1
}

R=$B/gqa.bin
build/tiny_llama_gen $R -d 64 -f 96 -l 2 -H 8 -k 4 -v 64 -s 1024 -S 7 -u >/dev/null 2>&1 ||
    { echo "FAIL test-mpi: tiny_llama_gen"; echo "0 passed, 1 failed"; exit 1; }
RND="--random 400 -n 24 --seed 3"

# 1. full attention: logits within 1e-4
if run 1 $B/full1.log $R $RND -a full --save $B/full1.rec &&
   run 2 $B/full2.log $R $RND -a full --check $B/full1.rec --tol 1e-4 --same-sel &&
   grep -q "rank 1: KV heads 2..3 of 4" $B/full2.log; then
    ok "full attention, 2 ranks vs 1: $(grep 'max |logit' $B/full2.log | cut -d';' -f1 | sed 's/check: //')"
else
    bad "full attention, 2 ranks vs 1 (logits within 1e-4)" $B/full2.log
fi

# 1b. the 2-rank forward computes tiny_llama.h's model: its own tl_forward over the
# same tokens (only the wo and w2 products are summed in another order, in double)
if run 2 $B/eng.log $R $RND -a full --vs-engine --tol 1e-4; then
    ok "full attention on 2 ranks vs tiny_llama.h's tl_forward: $(sed -n 's/^vs-engine: //p' $B/eng.log)"
else
    bad "full attention on 2 ranks vs tiny_llama.h's tl_forward (within 1e-4)" $B/eng.log
fi

# 2. oracle: the same tokens per KV head
if run 1 $B/or1.log $R $RND -a oracle -b 0.2 -S 4 --save $B/or1.rec &&
   run 2 $B/or2.log $R $RND -a oracle -b 0.2 -S 4 --check $B/or1.rec --tol 1e-4 --same-sel &&
   grep -q "selections differing from the reference: 0 of 192" $B/or2.log; then
    ok "oracle, 2 ranks vs 1: every KV head selects the same tokens (192 step x layer x head)"
else
    bad "oracle, 2 ranks vs 1 (identical selections)" $B/or2.log
fi

# 3. pqcache over everything = full attention
if run 2 $B/pqall.log $R $RND -a pqcache -b 1 -S 4 -T 4 --check $B/full1.rec --tol 1e-4 --same-sel; then
    ok "pqcache -b 1 on 2 ranks = full attention on 1 rank: $(grep 'max |logit' $B/pqall.log | cut -d';' -f1 | sed 's/check: //')"
else
    bad "pqcache -b 1 on 2 ranks = full attention on 1 rank" $B/pqall.log
fi

# 4. the passkey at 2K: retrieved; 2-rank selections = the 1-rank run's, head by head
P=build/passkey_hard.bin
build/make_passkey --hard --prompt 2048 50 11 > $B/p2k.txt
build/make_passkey --hard --prompt 8192 25 12 > $B/p8k.txt
PQ="-a pqcache -T 10 --split fixed-compete"
if run 1 $B/pk1.log $P --widen 2 --prompt-file $B/p2k.txt -n 8 $PQ --save $B/pk1.rec &&
   grep -q ": retrieved" $B/pk1.log; then
    ok "passkey 2K, pqcache, 1 rank: retrieved"
else
    bad "passkey 2K, pqcache, 1 rank: retrieved" $B/pk1.log
fi
if run 2 $B/pk2.log $P --widen 2 --prompt-file $B/p2k.txt -n 8 $PQ --check $B/pk1.rec --sel-only \
       --same-sel && grep -q ": retrieved" $B/pk2.log &&
   grep -q "selections differing from the reference: 0 of 32" $B/pk2.log &&
   grep -q "per KV head (8 steps x 2 layers each): 0 0$" $B/pk2.log; then
    ok "passkey 2K, pqcache, 2 ranks: retrieved; every KV head selects what it selected on 1 rank (32 of 32)"
else
    bad "passkey 2K, pqcache, 2 ranks (retrieved, identical selections per KV head)" $B/pk2.log
fi

# 5. the passkey at 8K on 2 ranks
if run 2 $B/pk8.log $P --widen 2 --prompt-file $B/p8k.txt -n 6 $PQ && grep -q ": retrieved" $B/pk8.log &&
   grep -q "rank 1: KV heads 1..1 of 2" $B/pk8.log; then
    ok "passkey 8K, pqcache, 2 ranks: retrieved"
else
    bad "passkey 8K, pqcache, 2 ranks: retrieved" $B/pk8.log
fi

# 6. errors
st=0; run 2 $B/e1.log $P --prompt-file $B/p2k.txt -n 2 || st=$?
if [ $st -ne 0 ] && [ $st -lt 128 ] && grep -q "2 ranks but the model has 1 KV heads" $B/e1.log; then
    ok "2 ranks on a model with 1 KV head: refused with a message"
else
    bad "2 ranks on a model with 1 KV head (exit $st)" $B/e1.log
fi
head -c 1000 $R > $B/cut.bin
st=0; run 2 $B/e2.log $B/cut.bin $RND || st=$?
if [ $st -ne 0 ] && [ $st -lt 128 ] && grep -q "truncated\|needs a file of" $B/e2.log; then
    ok "truncated checkpoint: refused with a message"
else
    bad "truncated checkpoint (exit $st)" $B/e2.log
fi
st=0; run 2 $B/e3.log $R $RND -a nonsense || st=$?
if [ $st -ne 0 ] && [ $st -lt 128 ] && grep -q "expected full, window, oracle or pqcache" $B/e3.log; then
    ok "bad option: refused with a message"
else
    bad "bad option (exit $st)" $B/e3.log
fi

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
