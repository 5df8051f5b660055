#!/usr/bin/env bash
# A local stand-in for the Dockerfile's default base (python:3.12-slim), for machines
# that reach Debian's packages but no image registry (CI here): Debian bookworm's
# python3 from `debootstrap`, a venv on PATH (so `python` and `pip` are the venv's, as
# in the slim image), imported into podman as $ONNXPS_BASE_IMAGE.
#
#   bash scripts/container_base.sh     # then: podman build --build-arg BASE=<image> .
#
# The root file system is built once per machine and kept (with a stamp) under
# $ONNXPS_BASE_CACHE; later runs only re-import it when the image is gone.
set -euo pipefail
IMAGE=${ONNXPS_BASE_IMAGE:-localhost/onnxps-base:bookworm}
CACHE=${ONNXPS_BASE_CACHE:-/var/cache/onnxps-base}
MIRROR=${ONNXPS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
TAR="$CACHE/rootfs.tar"

if podman image exists "$IMAGE"; then
  echo "== base image $IMAGE already present"
  exit 0
fi
if [ ! -f "$TAR.stamp" ] || [ ! -f "$TAR" ]; then
  echo "== debootstrap bookworm (python3, python3-venv) into $CACHE/rootfs"
  rm -rf "$CACHE/rootfs" "$TAR" "$TAR.stamp"
  mkdir -p "$CACHE"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$CACHE/rootfs" "$MIRROR"
  chroot "$CACHE/rootfs" /usr/bin/python3 -m venv /opt/venv
  rm -rf "$CACHE/rootfs/var/cache/apt/archives/"*.deb \
    "$CACHE/rootfs/var/lib/apt/lists/"* "$CACHE/rootfs/usr/share/doc" \
    "$CACHE/rootfs/usr/share/man" "$CACHE/rootfs/usr/share/locale"
  tar -C "$CACHE/rootfs" --exclude='./dev/*' --exclude='./proc/*' \
    --exclude='./sys/*' -cf "$TAR" .
  rm -rf "$CACHE/rootfs"
  date -u +%FT%TZ > "$TAR.stamp"
fi
echo "== podman import $TAR as $IMAGE"
podman import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python"]' \
  "$TAR" "$IMAGE"
