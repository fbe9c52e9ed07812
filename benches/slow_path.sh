#!/usr/bin/env bash
# A storage path of known, kernel-enforced bandwidth: a loop device with an
# ext4 file system, throttled by the block I/O controller (cgroup v1 blkio or
# cgroup v2 io.max, whichever this machine has), mounted under /mnt.
#
#   benches/slow_path.sh up NAME SIZE_MIB RATE_MIB_S [ram|disk] [BACKING_DIR]
#       prints the mount point; `ram` backs the device with a file in /dev/shm
#       (no disk traffic), `disk` with a file on BACKING_DIR (default: the
#       current directory) opened with O_DIRECT by the loop driver.
#   benches/slow_path.sh down NAME
#   benches/slow_path.sh rate NAME RATE_MIB_S      change the limit of a path that is up
#
# Needs root and loop devices; exits 3 (and says why) where they are missing,
# so that callers can skip. Tests and benchmarks use it for multi-path offload
# with paths of genuinely different speed: the rate is the kernel's, not a
# delay inside tierstore.
set -euo pipefail

cmd=${1:-}
name=${2:-}
[[ -n $cmd && -n $name && $name =~ ^[A-Za-z0-9_-]+$ ]] || {
	sed -n '2,17p' "$0" >&2
	exit 2
}
mnt=/mnt/tierstore-$name
state=/dev/shm/tierstore-path-$name

unavailable() {
	echo "slow_path: $*" >&2
	exit 3
}

limit() { # MAJ:MIN BYTES_PER_SECOND (0: no limit)
	local dev=$1 bps=$2
	if [[ -w /sys/fs/cgroup/blkio/blkio.throttle.read_bps_device ]]; then
		echo "$dev $bps" >/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device
		echo "$dev $bps" >/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device
	elif [[ -w /sys/fs/cgroup/io.max ]]; then
		local v=$bps
		[[ $v == 0 ]] && v=max
		echo "$dev rbps=$v wbps=$v" >/sys/fs/cgroup/io.max
	else
		return 1
	fi
}

case $cmd in
up)
	size=${3:?size in MiB}
	rate=${4:?rate in MiB/s}
	kind=${5:-ram}
	[[ $(id -u) == 0 ]] || unavailable "needs root"
	command -v losetup >/dev/null && command -v mkfs.ext4 >/dev/null || unavailable "losetup or mkfs.ext4 missing"
	[[ -e /dev/loop-control ]] || unavailable "no loop devices"
	if mountpoint -q "$mnt"; then
		"$0" down "$name"
	fi
	if [[ $kind == ram ]]; then
		img=$state.img
	else
		img=$(realpath "${6:-.}")/.tierstore-path-$name.img
	fi
	truncate -s "${size}M" "$img"
	direct=off
	[[ $kind == disk ]] && direct=on
	dev=$(losetup -f --show --direct-io=$direct "$img" 2>/dev/null) || {
		rm -f "$img"
		unavailable "could not attach a loop device"
	}
	echo "$dev $img" >"$state"
	mkfs.ext4 -q -F -E nodiscard "$dev"
	mkdir -p "$mnt"
	mount -o discard "$dev" "$mnt" || {
		"$0" down "$name"
		unavailable "could not mount $dev"
	}
	majmin=$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')
	limit "$majmin" $((rate * 1024 * 1024)) || {
		"$0" down "$name"
		unavailable "no writable block I/O controller"
	}
	echo "$mnt"
	;;
rate)
	read -r dev _img <"$state"
	limit "$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')" $((${3:?rate} * 1024 * 1024))
	;;
down)
	[[ -f $state ]] || exit 0
	read -r dev img <"$state"
	majmin=$(lsblk -dno MAJ:MIN "$dev" 2>/dev/null | tr -d ' ') || true
	umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
	[[ -n $majmin ]] && limit "$majmin" 0 2>/dev/null || true
	losetup -d "$dev" 2>/dev/null || true
	rm -f "$img" "$state"
	rmdir "$mnt" 2>/dev/null || true
	;;
*)
	sed -n '2,17p' "$0" >&2
	exit 2
	;;
esac
