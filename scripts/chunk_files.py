"""Lay a folder of wheels out as chunk1/, chunk2/, ... of at most MIB MiB each (for a transfer that carries at most
64 MiB at a time); a bigger file is split into NAME.part-aa, -ab, ... (``scripts/gpu_check.sh`` joins them).

    python scripts/chunk_files.py DEST MIB [EXTRA_FILE ...]

Takes the ``.whl`` and ``.tar.gz`` files of DEST and the EXTRA_FILEs named (e.g. PINS.txt), biggest first, first fit.
Used by ``scripts/pack_wheels.sh`` and ``scripts/pack_megatron_wheels.sh``.
"""

import os
import sys

dest, limit, extra = sys.argv[1], int(float(sys.argv[2]) * 2**20), set(sys.argv[3:])
pieces = []  # (name, bytes) in the order they are filled into chunks
for f in sorted(os.listdir(dest), key=lambda f: -os.path.getsize(os.path.join(dest, f))):
    if not (f.endswith((".whl", ".tar.gz")) or f in extra):
        continue
    data = open(os.path.join(dest, f), "rb").read()
    if len(data) <= limit:
        pieces.append((f, data))
    else:
        for i in range(0, len(data), limit):
            suffix = chr(ord("a") + i // limit // 26) + chr(ord("a") + i // limit % 26)
            pieces.append((f"{f}.part-{suffix}", data[i : i + limit]))
chunks = []  # first fit, biggest first
for name, data in pieces:
    for c in chunks:
        if c[0] + len(data) <= limit:
            c[0] += len(data)
            c[1].append((name, data))
            break
    else:
        chunks.append([len(data), [(name, data)]])
for k, (size, files) in enumerate(chunks, 1):
    os.makedirs(os.path.join(dest, f"chunk{k}"))
    for name, data in files:
        open(os.path.join(dest, f"chunk{k}", name), "wb").write(data)
    print(f"  chunk{k}: {len(files)} files, {size / 2**20:.1f} MiB")
