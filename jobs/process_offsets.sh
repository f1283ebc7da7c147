#!/usr/bin/env bash
# Does a process's speed at a sub-millisecond GPU point depend on the process (docs/gate-error-rates.md)? Six
# rounds of processes, one after the other, interleaving what they differ in: nothing, the hash seed, the core,
# both, and address-space randomization off with a fixed hash seed. Usage: bash jobs/process_offsets.sh
export PYTHONPATH=.
nvidia-smi -L
python jobs/process_offsets.py warm-up > /dev/null 2>&1  # Triton's cache
for i in 1 2 3 4 5 6; do
  python jobs/process_offsets.py plain
  PYTHONHASHSEED=0 python jobs/process_offsets.py hash-seed
  taskset -c 3 python jobs/process_offsets.py pinned
  PYTHONHASHSEED=0 taskset -c 3 python jobs/process_offsets.py hash-seed-pinned
  PYTHONHASHSEED=0 setarch "$(uname -m)" -R python jobs/process_offsets.py hash-seed-no-aslr
done
