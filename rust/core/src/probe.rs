//! Probes of what the kernel and a file system allow: io_uring, O_DIRECT and
//! its alignment. Results are reported by `tierstore info`, never assumed.

use std::ffi::CString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::OnceLock;

use crate::buf::DEFAULT_ALIGN;

/// Whether a virtio balloon with free page reporting is bound here: the
/// guest then hands free 2 MiB blocks back to its host, and the first touch
/// of a fresh huge page costs a host allocation (measured several times the
/// cost of populating the same bytes as 4 KiB pages, which come from recently
/// freed, still-backed memory).
pub fn free_page_reporting() -> bool {
    // VIRTIO_BALLOON_F_REPORTING is feature bit 5; `features` lists bits as '0'/'1'.
    const F_REPORTING: usize = 5;
    let Ok(dir) = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon") else {
        return false;
    };
    dir.filter_map(std::result::Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("virtio"))
        .any(|e| {
            std::fs::read(e.path().join("features"))
                .is_ok_and(|f| f.get(F_REPORTING) == Some(&b'1'))
        })
}

/// Whether io_uring can be used here, and if not, why.
pub fn io_uring_status() -> Result<(), String> {
    static STATUS: OnceLock<Result<(), String>> = OnceLock::new();
    STATUS
        .get_or_init(|| {
            if let Ok(v) = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled") {
                if v.trim() == "2" {
                    return Err("disabled by the kernel (kernel.io_uring_disabled = 2)".into());
                }
            }
            let ring =
                io_uring::IoUring::new(8).map_err(|e| format!("io_uring_setup failed: {e}"))?;
            let mut probe = io_uring::Probe::new();
            ring.submitter()
                .register_probe(&mut probe)
                .map_err(|e| format!("io_uring probe failed: {e}"))?;
            for (code, name) in [
                (io_uring::opcode::Read::CODE, "READ"),
                (io_uring::opcode::Write::CODE, "WRITE"),
            ] {
                if !probe.is_supported(code) {
                    return Err(format!("the kernel's io_uring lacks the {name} opcode"));
                }
            }
            Ok(())
        })
        .clone()
}

/// Where an O_DIRECT alignment figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlignSource {
    /// `statx(STATX_DIOALIGN)` on a file of that file system.
    Statx,
    /// The logical block size of the block device under the path.
    BlockDevice,
    /// Neither was available; the safe default.
    Default,
}

impl AlignSource {
    pub fn as_str(self) -> &'static str {
        match self {
            AlignSource::Statx => "statx",
            AlignSource::BlockDevice => "block device",
            AlignSource::Default => "default",
        }
    }
}

/// O_DIRECT requirements of one file (or of the file system holding a path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of memory addresses.
    pub mem: u64,
    /// Required alignment of file offsets and lengths.
    pub offset: u64,
    pub source: AlignSource,
}

impl DioAlign {
    /// One alignment that satisfies both requirements and our default.
    pub fn io_align(&self) -> u64 {
        self.mem.max(self.offset).max(512)
    }
}

/// `statx(STATX_DIOALIGN)` on an open file: `Some((mem, offset))`, with zeros
/// meaning the file system does not support O_DIRECT for this file.
pub fn statx_dio_align(file: &File) -> Option<(u64, u64)> {
    // SAFETY: an all-zero `statx` is a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: valid fd, a NUL-terminated empty path with AT_EMPTY_PATH, and a
    // properly sized output struct that lives across the call.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &raw mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some((
        u64::from(stx.stx_dio_mem_align),
        u64::from(stx.stx_dio_offset_align),
    ))
}

/// Logical block size of the block device holding `dev`, from sysfs.
fn block_device_lbs(dev: u64) -> Option<u64> {
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    let base = format!("/sys/dev/block/{maj}:{min}");
    for rel in ["queue/logical_block_size", "../queue/logical_block_size"] {
        if let Ok(s) = std::fs::read_to_string(format!("{base}/{rel}")) {
            if let Ok(v) = s.trim().parse::<u64>() {
                if v.is_power_of_two() {
                    return Some(v);
                }
            }
        }
    }
    None
}

/// O_DIRECT alignment for an open file: statx first, then the block device,
/// then 4096.
pub fn dio_align_of(file: &File) -> DioAlign {
    if let Some((mem, offset)) = statx_dio_align(file) {
        if mem > 0 && offset > 0 {
            return DioAlign {
                mem,
                offset,
                source: AlignSource::Statx,
            };
        }
    }
    if let Ok(md) = file.metadata() {
        if let Some(lbs) = block_device_lbs(md.dev()) {
            return DioAlign {
                mem: lbs,
                offset: lbs,
                source: AlignSource::BlockDevice,
            };
        }
    }
    DioAlign {
        mem: DEFAULT_ALIGN as u64,
        offset: DEFAULT_ALIGN as u64,
        source: AlignSource::Default,
    }
}

/// What a directory's file system allows: O_DIRECT or not (with the reason),
/// and the alignment.
#[derive(Clone, Debug)]
pub struct PathProbe {
    pub direct: Result<DioAlign, String>,
    pub fs_type: String,
}

/// Probes `dir` by creating (and removing) a small temporary file in it.
pub fn probe_dir(dir: &Path) -> std::io::Result<PathProbe> {
    let fs_type = fs_type_name(dir);
    let name = dir.join(format!(".tierstore-probe.{}", std::process::id()));
    let cname = CString::new(name.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: NUL-terminated path; flags are plain constants.
    let fd = unsafe {
        libc::open(
            cname.as_ptr(),
            libc::O_CREAT | libc::O_WRONLY | libc::O_DIRECT | libc::O_CLOEXEC | libc::O_TRUNC,
            0o600,
        )
    };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) {
            return Ok(PathProbe {
                direct: Err(format!("{fs_type} refuses O_DIRECT (EINVAL)")),
                fs_type,
            });
        }
        return Err(err);
    }
    // SAFETY: `fd` was just opened and is owned by the new `File`.
    let file = unsafe { <File as std::os::unix::io::FromRawFd>::from_raw_fd(fd) };
    let align = dio_align_of(&file);
    drop(file);
    let _ = std::fs::remove_file(&name);
    if align.source == AlignSource::Statx || align.mem > 0 {
        Ok(PathProbe {
            direct: Ok(align),
            fs_type,
        })
    } else {
        Ok(PathProbe {
            direct: Err("statx reports no O_DIRECT support".into()),
            fs_type,
        })
    }
}

/// A readable name for the file system type of `path` (from statfs).
pub fn fs_type_name(path: &Path) -> String {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: zeroed statfs is a valid value of the C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: NUL-terminated path and a valid output struct.
    if unsafe { libc::statfs(c.as_ptr(), &raw mut st) } != 0 {
        return "unknown".into();
    }
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as i64;
    match magic {
        0xEF53 => "ext4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x0102_1994 => "tmpfs".into(),
        0x6969 => "nfs".into(),
        0x794C_7630 => "overlayfs".into(),
        0x6573_5546 => "fuse".into(),
        0x2FC1_2FC1 => "zfs".into(),
        0x0BD0_0BD0 => "lustre".into(),
        0x4750_4653 => "gpfs".into(),
        0x5346_544E => "ntfs".into(),
        other => format!("0x{other:x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_temp_dir() {
        let d = tempfile::tempdir().unwrap();
        let p = probe_dir(d.path()).unwrap();
        if let Ok(a) = p.direct {
            assert!(a.mem.is_power_of_two() && a.offset.is_power_of_two());
            assert!(a.io_align() >= 512);
        }
        assert!(
            std::fs::read_dir(d.path()).unwrap().next().is_none(),
            "probe file removed"
        );
    }

    #[test]
    fn io_uring_probe_answers() {
        // Either available or a reason; never a panic.
        match io_uring_status() {
            Ok(()) => {}
            Err(why) => assert!(!why.is_empty()),
        }
    }
}
