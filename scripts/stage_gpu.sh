#!/usr/bin/env bash
# Pack DALI and the wheels the GPU image lacks into parts that fit one device call each.
#
# Our fixed copy of the workplace recipe (../shared/gpu/stage.sh). Two changes, both from
# the H100 run of 2026-11-22:
#   * the wheels are installed BEFORE DALI is unpacked. `pip install --target` skips a
#     top-level folder that already exists, and DALI's tree has `nvidia/`, so after DALI
#     nvidia-nvcomp (nvidia/nvcomp) was silently left out and every zstd/lz4 array took
#     the host-decode path;
#   * parts are 61 MiB (5 calls instead of 7): a call carries 64 MiB with the repo (~1 MiB).
#
# Usage, from the project root, with /.gpu/ in .git/info/exclude:
#   DZ_GPU_EXTRA="$(bash scripts/gpu_check.sh extra)" bash scripts/stage_gpu.sh
# then make the printed device calls back to back (the machine goes back after ~30 s idle).
set -euo pipefail

dali=${DZ_DALI:-nvidia-dali-cuda120==2.4.0}
# pinned where a new release could break the install (--no-deps) or change what is measured:
# the versions of the 2026-11-22 H100 run (benchmarks/results/h100-2026-11-22/)
wheels="astunparse gast makefun optree nvtx libcst~=1.8.0 zarr==3.4.2 numcodecs==0.17.1 donfig
  crc32c google-crc32c typing_extensions msgspec rapids-logger==0.3.* kvikio-cu13==26.10.*
  libkvikio-cu13==26.10.*
  nvidia-nvcomp-cu12==5.3.0.16 nvidia-libnvcomp-cu12==5.3.0.16 ${DZ_GPU_EXTRA:-}"
cache=${TMPDIR:-/tmp}/dz-gpu
part_mib=${DZ_PART_MIB:-61}

[ -d .git ] || { echo "run from the project root" >&2; exit 2; }
git check-ignore -q .gpu/x || { echo "add '/.gpu/' to .git/info/exclude first" >&2; exit 2; }
mkdir -p "$cache/whl"
tag=$(echo "$dali" | tr -c 'A-Za-z0-9.\n' '_')
if [ ! -s "$cache/$tag.tar.xz" ]; then  # DALI's tree, xz'd once (minutes) and cached
  python3 -m pip download -q --no-deps -d "$cache/whl" "$dali"
  rm -rf "$cache/tree" && mkdir -p "$cache/tree"
  python3 -m zipfile -e "$(ls -t "$cache"/whl/nvidia_dali*.whl | head -1)" "$cache/tree"
  tar -C "$cache/tree" -cf - . | xz -T0 -6 >"$cache/$tag.tar.xz.tmp"
  mv "$cache/$tag.tar.xz.tmp" "$cache/$tag.tar.xz" && rm -rf "$cache/tree"
fi
rm -rf "$cache/payload" .gpu && mkdir -p "$cache/payload/wheels" .gpu
for spec in $wheels; do  # cp312 manylinux wheels for the image's Python 3.12
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$cache/payload/wheels" "$spec"
done
cp "$cache/$tag.tar.xz" "$cache/payload/dali.tar.xz"
tar -C "$cache/payload" -cf - . | split -b "${part_mib}m" -d -a 2 - .gpu/part
n=$(ls .gpu/part* | wc -l)

cat >.gpu/install.sh <<EOF
#!/usr/bin/env bash
# Source this on the GPU machine: joins the $n parts once, installs into ~/dz/site, sets PYTHONPATH.
root=\${DZ_ROOT:-\$HOME/dz}
if [ ! -f "\$root/site/.ok" ]; then
  have=\$(ls "\$root"/part* 2>/dev/null | wc -l)
  [ "\$have" = "$n" ] || { echo "have \$have of $n parts: the machine went back between calls; start again"; return 3 2>/dev/null || exit 3; }
  rm -rf "\$root/payload" "\$root/site" && mkdir -p "\$root/payload" "\$root/site"
  # every step must succeed before .ok is written: a failed install marked good would be
  # skipped by every later call on this machine
  if cat "\$root"/part* | tar -x -C "\$root/payload" \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "\$root/site" "\$root"/payload/wheels/*.whl \
    && xz -d <"\$root/payload/dali.tar.xz" | tar -x -C "\$root/site"; then
    rm -rf "\$root/payload" "\$root"/part* && touch "\$root/site/.ok"
  else
    echo "staging failed (see above); the parts are kept: source .gpu/install.sh again"
    return 4 2>/dev/null || exit 4
  fi
fi
export PYTHONPATH=\$root/site:\$PWD\${PYTHONPATH:+:\$PYTHONPATH}
python3 -c "import nvidia.dali as d, kvikio, nvidia.nvcomp as n, zarr; print('staged: DALI', d.__version__, 'kvikio', kvikio.__version__, 'nvCOMP', n.__version__, 'zarr', zarr.__version__)"
EOF
chmod +x .gpu/install.sh

echo "$n parts in .gpu/ ($(du -sh .gpu | cut -f1)). Device calls, back to back:"
i=0
for p in .gpu/part*; do
  i=$((i + 1))
  if [ "$i" -lt "$n" ]; then
    echo "  $i. carry=[\"$p\"]  command: mkdir -p ~/dz && cp $p ~/dz/"
  else
    echo "  $i. carry=[\"$p\", \".gpu/install.sh\"]  command: mkdir -p ~/dz && cp $p ~/dz/ && source .gpu/install.sh && bash scripts/gpu_check.sh tests"
  fi
done
echo "Then, same warm machine: carry=[\".gpu/install.sh\"], 'source .gpu/install.sh && bash scripts/gpu_check.sh bench'."
