#!/bin/bash
# Build megareason's GPU image with its base pinned by digest:
#   bash containers/build.sh [TAG] [extra docker build arguments]      # from anywhere; TAG default megareason:latest
# containers/base-image names the base. When it holds a tag only (IMAGE:TAG), this script resolves the tag's
# digest from the registry (docker buildx imagetools), writes IMAGE:TAG@sha256:... back into the file and
# builds from it: commit that file, and every later build uses the same base. Needs Docker with buildx.
set -euo pipefail
cd "$(dirname "$0")/.."
file=containers/base-image
base=$(grep -v '^\s*#' "$file" | grep -m1 .)
if [[ $base != *@sha256:* ]]; then
    digest=$(docker buildx imagetools inspect "$base" --format '{{json .Manifest}}' |
             python3 -c 'import json, sys; print(json.load(sys.stdin)["digest"])')
    [[ $digest == sha256:* ]] || { echo "could not resolve the digest of $base" >&2; exit 1; }
    sed -i "s|^$base\$|$base@$digest|" "$file"
    base=$base@$digest
    echo "pinned the base image in $file: $base (commit it)"
fi
docker build -f containers/Dockerfile --build-arg BASE_IMAGE="$base" -t "${1:-megareason:latest}" "${@:2}" .
