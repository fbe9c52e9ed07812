//! Arbitrary bytes as an archive: `zip::read_directory`, then
//! `zip::data_offset_from_local` and `zip::check_data_range` on every entry,
//! with every property of `tierstore_fuzz::check_file`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tierstore_fuzz::check_file(data);
});
