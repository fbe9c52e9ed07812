//! Files as the engine opens them: O_DIRECT where the file system allows it,
//! buffered otherwise, and the atomic-replace protocol for writes.
//!
//! A save writes `.<name>.tierstore-tmp.<pid>.<n>` in the target directory,
//! fsyncs it, renames it over `<name>`, and fsyncs the directory. A crash at
//! any moment leaves either the old file or the new one; a temporary file left
//! by a killed process is removed by the next successful save to that name.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::os::unix::io::{AsRawFd, FromRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::probe::{dio_align_of, DioAlign};

const TMP_MARK: &str = ".tierstore-tmp.";

fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("path contains a NUL byte: {}", p.display())))
}

fn open_raw(path: &Path, flags: i32, mode: libc::mode_t) -> io::Result<File> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: NUL-terminated path, plain flags.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            flags | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Opens `path` with `flags`, adding O_DIRECT when `want_direct` and the
/// file system accepts it; returns the file, whether it is direct, and why
/// not when it is not. Errors name `report` (the path the user gave).
fn open_maybe_direct(
    path: &Path,
    flags: i32,
    mode: libc::mode_t,
    want_direct: bool,
    report: &Path,
    what: &'static str,
) -> Result<(File, bool, Option<String>)> {
    if want_direct {
        match open_raw(path, flags | libc::O_DIRECT, mode) {
            Ok(f) => return Ok((f, true, None)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let f = open_raw(path, flags, mode).map_err(|e| Error::io(report, what, e))?;
                return Ok((
                    f,
                    false,
                    Some("the file system refuses O_DIRECT".to_owned()),
                ));
            }
            Err(e) => return Err(Error::io(report, what, e)),
        }
    }
    let f = open_raw(path, flags, mode).map_err(|e| Error::io(report, what, e))?;
    Ok((f, false, Some("buffered I/O requested".to_owned())))
}

/// The length of `file` when it is a regular file (checked on the open
/// descriptor, so a path swapped after a check cannot slip through). The
/// file was opened with O_NONBLOCK so that a FIFO does not block the open;
/// the flag is cleared here, because io_uring fails (instead of waiting)
/// reads on a descriptor that carries it.
fn regular_len(file: &File, path: &Path) -> Result<u64> {
    use std::os::unix::fs::FileTypeExt;
    let meta = file.metadata().map_err(|e| Error::io(path, "stat", e))?;
    let ft = meta.file_type();
    if ft.is_file() {
        let fd = file.as_raw_fd();
        // SAFETY: fcntl on a descriptor we own; no memory arguments.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
            return Err(Error::io(path, "fcntl", io::Error::last_os_error()));
        }
        return Ok(meta.len());
    }
    let kind = if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_dir() {
        "a directory"
    } else {
        "not a file"
    };
    Err(Error::NotRegular {
        path: path.to_path_buf(),
        kind,
    })
}

/// fallocate of `[0, len)`; file systems without it are not an error.
fn reserve_fd(file: &File, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: valid fd; fallocate has no memory arguments.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) {
            return Err(e);
        }
    }
    Ok(())
}

/// A file opened for engine I/O.
pub struct EngineFile {
    pub file: File,
    pub path: PathBuf,
    /// True when opened with O_DIRECT.
    pub direct: bool,
    /// Why O_DIRECT is off, when it is.
    pub buffered_reason: Option<String>,
    /// Alignment every transfer on this file uses (1 when buffered).
    pub align: u64,
    pub dio: DioAlign,
    pub len: u64,
    pub dev: u64,
}

impl EngineFile {
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Opens `path` for reading, with O_DIRECT when `want_direct` and the
    /// file system allows it.
    ///
    /// Only regular files are read: the file is opened without blocking (a
    /// FIFO would otherwise wait for a writer forever) and refused when the
    /// descriptor is anything else.
    pub fn open_read(path: &Path, want_direct: bool) -> Result<Self> {
        refuse_directory(path)?;
        let (file, direct, reason) = open_maybe_direct(
            path,
            libc::O_RDONLY | libc::O_NONBLOCK,
            0,
            want_direct,
            path,
            "open",
        )?;
        let len = regular_len(&file, path)?;
        Ok(Self::wrap(file, path, direct, reason, len))
    }

    /// Opens `path` for rewriting ranges in place (created when missing), with
    /// O_DIRECT when `want_direct` and the file system allows it. A file
    /// shorter than `len` is extended with space reserved, so that a full disk
    /// fails here, before any data is written, and not in the middle of it.
    pub fn open_write(path: &Path, want_direct: bool, len: u64) -> Result<Self> {
        let (file, direct, reason) = open_maybe_direct(
            path,
            libc::O_RDWR | libc::O_CREAT,
            0o644,
            want_direct,
            path,
            "open for writing",
        )?;
        let have = file
            .metadata()
            .map_err(|e| Error::io(path, "stat", e))?
            .len();
        if have < len {
            reserve_fd(&file, len).map_err(|e| Error::io(path, "reserve space", e))?;
            if file.metadata().map_or(0, |m| m.len()) < len {
                file.set_len(len)
                    .map_err(|e| Error::io(path, "extend", e))?;
            }
        }
        Ok(Self::wrap(file, path, direct, reason, have.max(len)))
    }

    fn wrap(file: File, path: &Path, direct: bool, reason: Option<String>, len: u64) -> Self {
        use std::os::unix::fs::MetadataExt;
        let dio = dio_align_of(&file);
        let align = if direct { dio.io_align() } else { 1 };
        let dev = file.metadata().map_or(0, |m| m.dev());
        EngineFile {
            file,
            path: path.to_path_buf(),
            direct,
            buffered_reason: reason,
            align,
            dio,
            len,
            dev,
        }
    }

    /// Plain positioned read of a small range through a buffered descriptor.
    pub fn read_small(&self, offset: u64, len: u64, what: &str) -> Result<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::truncated(
                &self.path,
                format!(
                    "{what} [{offset}, +{len}) lies beyond the end of the file ({} bytes)",
                    self.len
                ),
            ));
        }
        let f = if self.direct {
            File::open(&self.path).map_err(|e| Error::io(&self.path, "open", e))?
        } else {
            self.file
                .try_clone()
                .map_err(|e| Error::io(&self.path, "open", e))?
        };
        let mut v = vec![0u8; len as usize];
        f.read_exact_at(&mut v, offset).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                Error::truncated(&self.path, format!("{what} is cut short"))
            } else {
                Error::io(&self.path, "read", e)
            }
        })?;
        Ok(v)
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A file being written under a temporary name, renamed into place on commit
/// and removed if dropped before.
pub struct AtomicFile {
    pub inner: EngineFile,
    final_path: PathBuf,
    dir: PathBuf,
    committed: bool,
}

impl AtomicFile {
    /// Creates the temporary file next to `final_path`.
    pub fn create(final_path: &Path, want_direct: bool) -> Result<Self> {
        let name = final_path
            .file_name()
            .ok_or_else(|| Error::Invalid(format!("not a file path: {}", final_path.display())))?;
        let dir = match final_path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::io(
                    &dir,
                    "open directory",
                    io::Error::from_raw_os_error(libc::ENOTDIR),
                ));
            }
            Err(e) => return Err(Error::io(&dir, "open directory", e)),
        }
        if let Ok(m) = std::fs::metadata(final_path) {
            if m.is_dir() {
                return Err(Error::io(
                    final_path,
                    "create",
                    io::Error::from_raw_os_error(libc::EISDIR),
                ));
            }
        }
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp_name = format!(
            ".{}{TMP_MARK}{}.{n}",
            name.to_string_lossy(),
            std::process::id()
        );
        let tmp = dir.join(tmp_name);
        let (file, direct, reason) = open_maybe_direct(
            &tmp,
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
            0o644,
            want_direct,
            final_path,
            "create temporary file",
        )?;
        Ok(AtomicFile {
            inner: EngineFile::wrap(file, &tmp, direct, reason, 0),
            final_path: final_path.to_path_buf(),
            dir,
            committed: false,
        })
    }

    pub fn final_path(&self) -> &Path {
        &self.final_path
    }

    /// Reserves `len` bytes so that a full disk fails before any data is written.
    pub fn reserve(&self, len: u64) -> Result<()> {
        reserve_fd(&self.inner.file, len)
            .map_err(|e| Error::io(&self.final_path, "reserve space", e))
    }

    /// Sets the final length (after aligned writes that ran past it).
    pub fn set_len(&self, len: u64) -> Result<()> {
        self.inner
            .file
            .set_len(len)
            .map_err(|e| Error::io(&self.final_path, "truncate", e))
    }

    /// fsync, rename over the final name, fsync the directory.
    pub fn commit(mut self, durable: bool) -> Result<()> {
        if durable {
            self.inner
                .file
                .sync_all()
                .map_err(|e| Error::io(&self.final_path, "fsync", e))?;
        }
        let from = cpath(&self.inner.path)?;
        let to = cpath(&self.final_path)?;
        let replaced = hold_replaced(&self.final_path);
        // SAFETY: two NUL-terminated paths.
        if unsafe { libc::rename(from.as_ptr(), to.as_ptr()) } != 0 {
            return Err(Error::io(
                &self.final_path,
                "rename",
                io::Error::last_os_error(),
            ));
        }
        self.committed = true;
        if durable {
            sync_dir(&self.dir)?;
        }
        release_in_background(replaced);
        remove_stale_temps(&self.final_path);
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.inner.path);
        }
    }
}

/// Files from this size up are let go of off the caller's thread when a
/// save replaces them.
const RELEASE_IN_BACKGROUND: u64 = 64 << 20;

/// An open handle on the large regular file a rename is about to replace.
///
/// Renaming over a file drops its last link, and the file system frees its
/// blocks inside `rename` (ext4: about 0.4 s for 2.5 GiB), time the save's
/// caller would wait for. Held open, the old file outlives the rename; it is
/// freed when the handle is closed on another thread. Anything but a regular
/// file, or a small one, is neither held nor opened (a file swapped in
/// between the look and the open is opened without blocking and checked again).
fn hold_replaced(path: &Path) -> Option<File> {
    // Looked at before it is opened: a save to a new name, or over a small
    // file, opens nothing it did not write.
    let seen = std::fs::symlink_metadata(path).ok()?;
    if !seen.file_type().is_file() || seen.len() < RELEASE_IN_BACKGROUND {
        return None;
    }
    let f = open_raw(
        path,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
        0,
    )
    .ok()?;
    let meta = f.metadata().ok()?;
    (meta.file_type().is_file() && meta.len() >= RELEASE_IN_BACKGROUND).then_some(f)
}

/// Closes a replaced file's handle on a thread of its own (inline when no
/// thread can be started), so that freeing its blocks costs the caller nothing.
fn release_in_background(replaced: Option<File>) {
    if let Some(f) = replaced {
        // Where no thread starts, the closure (and the file with it) is dropped here.
        let _ = std::thread::Builder::new()
            .name("tierstore-release".into())
            .spawn(move || drop(f));
    }
}

/// fsyncs a directory so that a rename in it is durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let d = open_raw(dir, libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| Error::io(dir, "open directory", e))?;
    d.sync_all()
        .map_err(|e| Error::io(dir, "fsync directory", e))
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes temporary files of earlier saves to `final_path` whose writer
/// process no longer exists.
pub fn remove_stale_temps(final_path: &Path) {
    let (Some(dir), Some(name)) = (final_path.parent(), final_path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!(".{}{TMP_MARK}", name.to_string_lossy());
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for ent in rd.flatten() {
        let fname = ent.file_name();
        let fname = fname.to_string_lossy();
        let Some(rest) = fname.strip_prefix(&prefix) else {
            continue;
        };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if pid == std::process::id() as i32 || !pid_alive(pid) {
            // Our own pid: any temp of ours with this prefix belongs to a save
            // that has already finished or been abandoned by this process.
            if pid == std::process::id() as i32 {
                continue;
            }
            let _ = std::fs::remove_file(ent.path());
        }
    }
}

/// `EISDIR` for a directory given where a file is to be read (and the
/// error of `stat` for a path that cannot be examined).
fn refuse_directory(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "open", e))?;
    if meta.is_dir() {
        return Err(Error::io(
            path,
            "open",
            io::Error::from_raw_os_error(libc::EISDIR),
        ));
    }
    Ok(())
}

/// A file as a [`crate::zip::ReadAt`] source (buffered positioned reads).
pub struct FileSource {
    file: File,
    len: u64,
}

impl FileSource {
    pub fn open(path: &Path) -> Result<Self> {
        refuse_directory(path)?;
        let file = open_raw(path, libc::O_RDONLY | libc::O_NONBLOCK, 0)
            .map_err(|e| Error::io(path, "open", e))?;
        let len = regular_len(&file, path)?;
        Ok(FileSource { file, len })
    }
}

impl crate::zip::ReadAt for FileSource {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_file_commit_and_abort() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("x.pt");
        std::fs::write(&target, b"old").unwrap();
        {
            let f = AtomicFile::create(&target, false).unwrap();
            f.inner.file.write_all_at(b"new!", 0).unwrap();
            // dropped without commit
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "temporary removed"
        );
        let f = AtomicFile::create(&target, false).unwrap();
        f.inner.file.write_all_at(b"new!", 0).unwrap();
        f.commit(true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new!");
    }

    #[test]
    fn a_large_file_replaced_by_a_commit_is_held_then_let_go() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("x.pt");
        let big = std::fs::File::create(&target).unwrap();
        big.set_len(RELEASE_IN_BACKGROUND).unwrap(); // sparse: the size is what counts
        drop(big);
        let held = hold_replaced(&target).expect("a large regular file is held");
        let f = AtomicFile::create(&target, false).unwrap();
        f.inner.file.write_all_at(b"new!", 0).unwrap();
        f.commit(true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new!");
        assert_eq!(held.metadata().unwrap().len(), RELEASE_IN_BACKGROUND); // the old inode, unlinked
        drop(held);
        // Small files, directories and missing paths are not held.
        std::fs::write(d.path().join("small"), b"x").unwrap();
        assert!(hold_replaced(&d.path().join("small")).is_none());
        assert!(hold_replaced(d.path()).is_none());
        assert!(hold_replaced(&d.path().join("missing")).is_none());
        // A FIFO is not waited on.
        let fifo = cpath(&d.path().join("fifo")).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(hold_replaced(&d.path().join("fifo")).is_none());
    }

    #[test]
    fn stale_temp_of_dead_process_is_removed() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("x.pt");
        // pid 2^22+1 is above the default pid_max and never alive.
        let stale = d.path().join(format!(".x.pt{TMP_MARK}4194305.0"));
        std::fs::write(&stale, b"junk").unwrap();
        let other = d.path().join(format!(".y.pt{TMP_MARK}4194305.0"));
        std::fs::write(&other, b"junk").unwrap();
        let f = AtomicFile::create(&target, false).unwrap();
        f.commit(false).unwrap();
        assert!(!stale.exists());
        assert!(other.exists(), "temps of other names are left alone");
    }

    #[test]
    fn errors_name_the_path() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("nope/x.pt");
        let e = AtomicFile::create(&missing, true).err().unwrap();
        assert!(e.to_string().contains("nope"), "{e}");
        let e = AtomicFile::create(d.path(), true).err().unwrap();
        assert!(matches!(e, Error::Io { .. } | Error::Invalid(_)), "{e}");
    }
}
