//! Copy blocks: the byte runs of a resharding load, described compactly.
//!
//! A load that reshards copies, per pair of saved and target pieces, an
//! n-D box of elements from a file into memory. In both the file and memory
//! the box is an affine grid of contiguous runs: a first byte, a run length,
//! and per outer dimension a count and a stride on each side. A column
//! shard of a row-sharded matrix is one block of `rows` runs, however many
//! rows there are; [`expand`] turns blocks into the runs themselves, sorted
//! and merged where they continue one another on both sides, so that the
//! caller hands over one block per piece pair instead of one object per run.

use std::sync::Arc;

use crate::chunks::{self, ChunkTable, Coverage, TableRange, Verified};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::file::EngineFile;
use crate::io::Class;
use crate::ranges::IoRange;

/// One outer dimension of a block: `count` steps of `src` bytes in the
/// file and `dst` bytes in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim {
    pub count: u64,
    pub src: i64,
    pub dst: i64,
}

/// An affine grid of runs of `run` bytes: the first at file offset `src`
/// and memory address `dst`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub src: u64,
    pub dst: usize,
    pub run: u64,
    pub dims: Vec<Dim>,
}

/// A run: `len` bytes at file offset `src`, to memory address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub src: u64,
    pub dst: usize,
    pub len: u64,
}

/// Decodes blocks from rows of little-endian 64-bit integers: per block
/// `[src, dst, run, count_1, src_stride_1, dst_stride_1, ..., count_k, ...]`
/// with `k = dims` outer dimensions (unused ones have count 1).
pub fn decode(raw: &[u8], dims: usize) -> Result<Vec<Block>> {
    let row = (3 + 3 * dims) * 8;
    if raw.len() % row != 0 {
        return Err(Error::Invalid(format!(
            "{} bytes of blocks are not whole rows of {row} bytes",
            raw.len()
        )));
    }
    let word = |r: &[u8], i: usize| {
        let b: [u8; 8] = r[i * 8..i * 8 + 8].try_into().expect("8 bytes");
        i64::from_le_bytes(b)
    };
    raw.chunks_exact(row)
        .map(|r| {
            let (src, dst, run) = (word(r, 0), word(r, 1), word(r, 2));
            if src < 0 || dst < 0 || run < 0 {
                return Err(Error::Invalid(format!(
                    "block with a negative offset, address or length ({src}, {dst}, {run})"
                )));
            }
            let mut ds = Vec::with_capacity(dims);
            for k in 0..dims {
                let count = word(r, 3 + 3 * k);
                if count < 0 {
                    return Err(Error::Invalid(format!(
                        "block dimension with count {count}"
                    )));
                }
                if count != 1 {
                    ds.push(Dim {
                        count: count as u64,
                        src: word(r, 4 + 3 * k),
                        dst: word(r, 5 + 3 * k),
                    });
                }
            }
            Ok(Block {
                src: src as u64,
                dst: dst as usize,
                run: run as u64,
                dims: ds,
            })
        })
        .collect()
}

/// Every run of `blocks`, joined where one continues another in both the
/// file and memory, in file order (the order the reads and the chunk
/// checks that follow want: they need no sort of their own then). Fails
/// when a run would start before byte 0 of the file or of memory (a block
/// whose strides walk backwards past its start).
pub fn expand(blocks: &[Block]) -> Result<Vec<Run>> {
    let total: u64 = blocks
        .iter()
        .filter(|b| b.run > 0)
        .map(|b| b.dims.iter().map(|d| d.count).product::<u64>())
        .sum();
    let mut runs: Vec<Run> = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
    // Blocks by their first byte in the file: a block's runs ascend in the
    // file (strides are positive in every layout tierstore plans), so the
    // runs come out in file order and the sort below only checks that.
    let mut order: Vec<&Block> = blocks.iter().collect();
    order.sort_by_key(|b| b.src);
    for b in order {
        if b.run == 0 || b.dims.iter().any(|d| d.count == 0) {
            continue;
        }
        let mut idx = vec![0u64; b.dims.len()];
        let (mut s, mut d) = (i128::from(b.src), b.dst as i128);
        loop {
            let (Ok(src), Ok(dst)) = (u64::try_from(s), usize::try_from(d)) else {
                return Err(Error::Invalid(format!(
                    "a block starting at file offset {} walks outside the file or memory",
                    b.src
                )));
            };
            runs.push(Run {
                src,
                dst,
                len: b.run,
            });
            // Odometer over the outer dimensions, innermost last.
            let mut k = b.dims.len();
            let done = loop {
                if k == 0 {
                    break true;
                }
                k -= 1;
                let dim = b.dims[k];
                idx[k] += 1;
                s += i128::from(dim.src);
                d += i128::from(dim.dst);
                if idx[k] < dim.count {
                    break false;
                }
                s -= i128::from(dim.src) * i128::from(dim.count);
                d -= i128::from(dim.dst) * i128::from(dim.count);
                idx[k] = 0;
            };
            if done {
                break;
            }
        }
    }
    crate::ranges::sort_unless_sorted(&mut runs, |r| (r.src, r.dst));
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(last) if last.src + last.len == r.src && last.dst + last.len as usize == r.dst => {
                last.len += r.len;
            }
            _ => out.push(r),
        }
    }
    Ok(out)
}

/// Bytes of the `block`-byte blocks of the file that `runs` touch, each
/// block counted once.
pub fn blocks_touched(runs: &[Run], block: u64) -> u64 {
    let mut spans: Vec<(u64, u64)> = runs
        .iter()
        .filter(|r| r.len > 0)
        .map(|r| (r.src / block, (r.src + r.len).div_ceil(block)))
        .collect();
    spans.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u64, u64)> = None;
    for (lo, hi) in spans {
        match cur.as_mut() {
            Some(c) if lo <= c.1 => c.1 = c.1.max(hi),
            _ => {
                if let Some(c) = cur {
                    total += c.1 - c.0;
                }
                cur = Some((lo, hi));
            }
        }
    }
    if let Some(c) = cur {
        total += c.1 - c.0;
    }
    total * block
}

/// What [`read_blocks`] did: bytes read and verified, and the bytes of the
/// 4 KiB blocks of the file that the runs touch (what a reader of whole
/// blocks, O_DIRECT or the page cache, reads at least).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlocksRead {
    pub verified: Verified,
    pub blocks_4k: u64,
}

/// Reads the runs of `blocks` from `file` into memory, each run inside one
/// record of `tables` (the records of the file), verified per `coverage`
/// ([`chunks::read_ranges_verified`]; with [`Coverage::Full`], every chunk
/// of every record a run reads from).
///
/// # Safety
///
/// Every run's memory (from `dst`, `len` bytes) must be valid for writes,
/// the runs must not overlap in memory, and nothing else may access that
/// memory until this call returns.
pub unsafe fn read_blocks(
    engine: &Arc<Engine>,
    file: &Arc<EngineFile>,
    blocks: &[Block],
    tables: Vec<ChunkTable>,
    coverage: Coverage,
    class: Class,
) -> Result<BlocksRead> {
    let runs = expand(blocks)?;
    let mut order: Vec<usize> = (0..tables.len()).collect();
    order.sort_unstable_by_key(|&i| tables[i].data_offset);
    let starts: Vec<u64> = order.iter().map(|&i| tables[i].data_offset).collect();
    // The records the runs read from, numbered in the order first met.
    let mut slot: Vec<Option<usize>> = vec![None; tables.len()];
    let mut used: Vec<usize> = Vec::new();
    let mut ranges: Vec<TableRange> = Vec::with_capacity(runs.len());
    for r in &runs {
        let k = starts.partition_point(|&s| s <= r.src);
        if k == 0 {
            return Err(Error::corrupt(
                &file.path,
                None,
                format!(
                    "a read at offset {} lies before the first stored record; the manifest is damaged",
                    r.src
                ),
            ));
        }
        let t = order[k - 1];
        let id = *slot[t].get_or_insert_with(|| {
            used.push(t);
            used.len() - 1
        });
        let len = usize::try_from(r.len)
            .map_err(|_| Error::Invalid(format!("a run of {} bytes", r.len)))?;
        ranges.push(TableRange {
            range: IoRange {
                offset: r.src,
                len,
                buf: r.dst as *mut u8,
            },
            table: id,
        });
    }
    let mut tables: Vec<Option<ChunkTable>> = tables.into_iter().map(Some).collect();
    let used: Vec<ChunkTable> = used
        .iter()
        .map(|&t| tables[t].take().expect("each record once"))
        .collect();
    // SAFETY: the caller's contract above.
    let verified =
        unsafe { chunks::read_ranges_verified(engine, file, &ranges, &used, coverage, class) }?;
    Ok(BlocksRead {
        verified,
        blocks_4k: blocks_touched(&runs, 4096),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(rows: &[Vec<i64>]) -> Vec<u8> {
        rows.iter()
            .flat_map(|r| r.iter().flat_map(|x| x.to_le_bytes()))
            .collect()
    }

    #[test]
    fn column_shard_is_one_block_of_row_runs() {
        // Rows of 8 elements (4 bytes each); the second quarter of every row of 3.
        let raw = enc(&[vec![1000 + 8, 0, 8, 3, 32, 8]]);
        let b = decode(&raw, 1).unwrap();
        let runs = expand(&b).unwrap();
        assert_eq!(
            runs,
            vec![
                Run {
                    src: 1008,
                    dst: 0,
                    len: 8
                },
                Run {
                    src: 1040,
                    dst: 8,
                    len: 8
                },
                Run {
                    src: 1072,
                    dst: 16,
                    len: 8
                },
            ]
        );
        assert_eq!(blocks_touched(&runs, 4096), 4096);
    }

    #[test]
    fn runs_continuing_on_both_sides_merge() {
        // Whole rows: each run continues the previous one in file and memory.
        let raw = enc(&[vec![0, 100, 16, 4, 16, 16], vec![64, 164, 16, 1, 0, 0]]);
        let runs = expand(&decode(&raw, 1).unwrap()).unwrap();
        assert_eq!(
            runs,
            vec![Run {
                src: 0,
                dst: 100,
                len: 80
            }]
        );
    }

    #[test]
    fn two_outer_dims_and_padding_dims() {
        let raw = enc(&[vec![0, 0, 1, 2, 100, 10, 3, 1000, 1, 1, 0, 0]]);
        let runs = expand(&decode(&raw, 3).unwrap()).unwrap();
        let dst: Vec<usize> = runs.iter().map(|r| r.dst).collect();
        let src: Vec<u64> = runs.iter().map(|r| r.src).collect();
        assert_eq!(src, vec![0, 100, 1000, 1100, 2000, 2100]);
        assert_eq!(dst, vec![0, 10, 1, 11, 2, 12]);
    }

    #[test]
    fn runs_come_in_file_order_whatever_the_memory_order() {
        // Two column blocks whose destinations lie in the reverse order of
        // their records (tensors allocated in another order than saved).
        let raw = enc(&[vec![4096, 0, 8, 2, 32, 8], vec![0, 640, 8, 2, 32, 8]]);
        let runs = expand(&decode(&raw, 1).unwrap()).unwrap();
        let src: Vec<u64> = runs.iter().map(|r| r.src).collect();
        let dst: Vec<usize> = runs.iter().map(|r| r.dst).collect();
        assert_eq!(src, vec![0, 32, 4096, 4128]);
        assert_eq!(dst, vec![640, 648, 0, 8]);
    }

    #[test]
    fn hostile_rows_are_refused() {
        assert!(decode(&[0u8; 20], 0).is_err());
        assert!(decode(&enc(&[vec![-1, 0, 4]]), 0).is_err());
        assert!(decode(&enc(&[vec![0, 0, 4, -2, 1, 1]]), 1).is_err());
        // Strides that walk back past the start of the file.
        let b = decode(&enc(&[vec![8, 0, 4, 3, -8, 4]]), 1).unwrap();
        assert!(expand(&b).is_err());
        assert!(expand(&decode(&enc(&[vec![0, 0, 0, 5, 1, 1]]), 1).unwrap())
            .unwrap()
            .is_empty());
    }
}
