//! An archive opened once: its validated central directory and the file it
//! came from, kept together so that the manifest, small records and data
//! offsets are read without opening the file or parsing the directory
//! again. This is the only place a file's zip structures are read; callers
//! above the binding see typed records, never zip bytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::file::FileSource;
use crate::reader;
use crate::zip::{self, CdEntry, Directory, ReadAt};

/// Threads that read local headers in parallel (a cold file with thousands
/// of records must not pay one seek at a time).
const HEADER_THREADS: usize = 16;

pub struct Archive {
    pub path: PathBuf,
    pub dir: Directory,
    src: FileSource,
    by_name: HashMap<String, usize>,
}

impl Archive {
    /// Opens `path` and reads and validates its directory
    /// ([`zip::read_directory`]).
    pub fn open(path: &Path) -> Result<Self> {
        let src = FileSource::open(path)?;
        let dir = zip::read_directory(&src, path)?;
        let by_name = dir
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        Ok(Archive {
            path: path.to_path_buf(),
            dir,
            src,
            by_name,
        })
    }

    pub fn entry(&self, name: &str) -> Result<&CdEntry> {
        self.by_name
            .get(name)
            .map(|&i| &self.dir.entries[i])
            .ok_or_else(|| Error::MissingRecord {
                path: self.path.clone(),
                record: name.to_string(),
            })
    }

    /// `len` bytes at `offset`, which must lie inside the file.
    pub fn read(&self, offset: u64, len: u64, what: &str) -> Result<Vec<u8>> {
        zip::read_at(&self.src, &self.path, offset, len, what)
    }

    /// The data offset of `e`, from its local header (checked to lie in the
    /// entry's own space, [`zip::check_data_range`]).
    pub fn local_data_offset(&self, e: &CdEntry) -> Result<u64> {
        let end =
            (e.header_offset + zip::local_header_probe_len(e.name.len())).min(self.dir.cd_offset);
        let b = self.read(e.header_offset, end - e.header_offset, "local header")?;
        zip::data_offset_from_local(&b, e, &self.dir, &self.path)
    }

    /// Every entry's data offset, from the local headers, in directory order.
    pub fn data_offsets(&self) -> Result<Vec<u64>> {
        reader::resolve_data_offsets(&self.src, &self.path, &self.dir, HEADER_THREADS)
    }

    /// Checks that the data of the named entry may start at `offset`
    /// (an offset a manifest states): inside the entry's own space.
    pub fn check_offset(&self, name: &str, offset: u64) -> Result<()> {
        zip::check_data_range(self.entry(name)?, offset, &self.dir, &self.path)
    }

    pub fn len(&self) -> u64 {
        self.src.len()
    }

    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, records: &[(&str, &[u8])]) -> PathBuf {
        let p = dir.join("a.zip");
        std::fs::write(&p, crate::zip::tests::build(records, 64)).unwrap();
        p
    }

    #[test]
    fn finds_offsets_and_refuses_damage() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            &[("a/data.pkl", b"pickle"), ("a/x", b"0123456789")],
        );
        let a = Archive::open(&p).unwrap();
        let off = a.local_data_offset(a.entry("a/x").unwrap()).unwrap();
        assert_eq!(a.read(off, 10, "x").unwrap(), b"0123456789");
        assert_eq!(a.data_offsets().unwrap()[1], off);
        a.check_offset("a/x", off).unwrap();
        assert!(matches!(
            a.check_offset("a/x", off + 1_000_000),
            Err(Error::Corrupt { .. })
        ));
        assert!(matches!(
            a.entry("a/nope"),
            Err(Error::MissingRecord { .. })
        ));
        assert!(matches!(
            a.read(a.len() - 2, 4, "tail"),
            Err(Error::Truncated { .. })
        ));
        // a local header that no longer starts with its signature
        let e = a.entry("a/x").unwrap().clone();
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[e.header_offset as usize] ^= 1;
        std::fs::write(&p, bytes).unwrap();
        let a = Archive::open(&p).unwrap();
        assert!(matches!(
            a.local_data_offset(&e),
            Err(Error::Corrupt { .. })
        ));
    }
}
