#!/usr/bin/env bash
# Copies this worktree (without build/ and .git) to the session checkout's ignored .cuda_src folder,
# which the device tool carries to the GPU machine.
set -e
src=$(cd "$(dirname "$0")/.." && pwd)
dst=/work/main/.cuda_src
rm -rf "$dst" && mkdir -p "$dst"
(cd "$src" && tar --exclude=./build --exclude=./.git -cf - .) | (cd "$dst" && tar -xf -)
du -sh "$dst"
