//! Encode and decode speed of the `tsz1` codec on one thread, on files of
//! raw little-endian elements (a snapshot and its reference):
//!
//!     cargo run --release -p tierstore-core --example codec_speed -- DATA REF [WIDTH] [THREADS] [encode|decode]
//!
//! Prints the ratio and the best of five encode and decode runs in GB/s.

use std::time::Instant;

use tierstore_core::codec::{decode, encode, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: codec_speed DATA REF [WIDTH] [THREADS] [encode|decode]");
        std::process::exit(2);
    }
    let data = std::fs::read(&args[1]).expect("read DATA");
    let reference = std::fs::read(&args[2]).expect("read REF");
    let width: usize = args.get(3).map_or(4, |s| s.parse().expect("WIDTH"));
    let threads: usize = args.get(4).map_or(1, |s| s.parse().expect("THREADS"));
    // Runs of each direction (a profile of one: 0 runs of the other).
    let (runs_e, runs_d): (usize, usize) = match args.get(5).map(String::as_str) {
        Some("encode") => (20, 1),
        Some("decode") => (1, 20),
        _ => (5, 5),
    };
    let opts = Options {
        threads,
        level: std::env::var("TSZ_LEVEL").map_or(1, |v| v.parse().expect("TSZ_LEVEL")),
        ..Options::default()
    };
    let mut best_e = f64::INFINITY;
    let mut enc = None;
    for _ in 0..runs_e {
        let t = Instant::now();
        let e = encode(&data, width, Some(&reference), &opts).expect("encode");
        best_e = best_e.min(t.elapsed().as_secs_f64());
        enc = Some(e);
    }
    let enc = enc.expect("encoded");
    let mut out = vec![0u8; data.len()];
    let mut best_d = f64::INFINITY;
    for _ in 0..runs_d {
        let t = Instant::now();
        decode(&enc.bytes, Some(&reference), &mut out, threads).expect("decode");
        best_d = best_d.min(t.elapsed().as_secs_f64());
    }
    assert!(out == data, "decode is not bit-exact");
    let n = data.len() as f64;
    println!(
        "{:.0} MiB, ratio {:.3}, transform {:?}, {:?}: encode {:.2} GB/s, decode {:.2} GB/s",
        n / f64::from(1 << 20),
        n / enc.bytes.len() as f64,
        enc.transform,
        enc.stats,
        n / best_e / 1e9,
        n / best_d / 1e9
    );
}
