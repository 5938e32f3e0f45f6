# The prologue every script in scripts/ sources first:
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# strict mode, the repository root as working directory ($here), and the set-up more than
# one script needs. It runs nothing else.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

# kvpool's dev environment: .venv/bin/python, built by scripts/bootstrap.sh if missing.
ensure_dev_venv() {
  [ -x .venv/bin/python ] || bash scripts/bootstrap.sh
}

# vLLM's CPU platform for kvpool's CPU runs (tests, replay, vLLM's suites): kvpool's opt-in
# platform plugin (kvpool.cpu_platform: vLLM's CpuPlatform whose config check does not require
# triton-cpu, which vLLM 0.34.0 demands on x86). vLLM consults platform plugins only when
# VLLM_TARGET_DEVICE is not cpu, so that variable goes.
use_cpu_platform() {
  export KVPOOL_CPU_PLATFORM="${KVPOOL_CPU_PLATFORM:-1}"
  if [ "${VLLM_TARGET_DEVICE:-}" = cpu ]; then unset VLLM_TARGET_DEVICE; fi
}

# chroot_mount ROOT: prepare the Debian chroot ROOT (debootstrap made it) for a run of
# this checkout: the host's CA bundle and resolver, the checkout bind-mounted at the same
# path, /proc and /dev; unmounted again when the script exits.
chroot_mount() {
  local root="$1"
  # Behind a TLS-intercepting proxy only the host's CA bundle verifies PyPI.
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  mkdir -p "$root$here" "$root/proc" "$root/dev"
  mount --bind "$here" "$root$here"
  mount -t proc proc "$root/proc"
  mount --bind /dev "$root/dev"
  # shellcheck disable=SC2064  # expanded now: $root is local to this function
  trap "umount $(printf '%q ' "$root/dev" "$root/proc" "$root$here")" EXIT
}

# in_chroot ROOT [VAR=VALUE...] COMMAND...: COMMAND in ROOT with a clean environment.
in_chroot() {
  local root="$1"
  shift
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}
