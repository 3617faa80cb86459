P=/tmp/final/compare.sh; PEERS=/root/peers; OUT=/tmp/final/out
main() { (cd /work/main && KVMEM=128MiB bash $P $PEERS /work/main/checkpoints/shakespeare-small $OUT/default-main $1 "ours-f32"); }
base() { (cd /tmp/base && PROJECT=/tmp/base PY=/work/main/.venv/bin/python KVMEM=128MiB bash $P $PEERS /tmp/base/checkpoints/shakespeare-small $OUT/default-base $1 "ours-f32"); }
echo "$(date +%T) load $(cut -d' ' -f1 /proc/loadavg) default rounds 3-5 start" >> $OUT/log.txt
base 3; main 3; main 4; base 4; base 5; main 5
echo "$(date +%T) load $(cut -d' ' -f1 /proc/loadavg) default rounds 3-5 done" >> $OUT/log.txt
