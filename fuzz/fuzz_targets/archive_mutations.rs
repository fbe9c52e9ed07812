//! A valid archive (records, zip64 forms and comment chosen by the input),
//! mutated as the rest of the input says, through the same checks as
//! `read_directory`. The unmutated archive must parse and resolve.
#![no_main]

use libfuzzer_sys::arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok((file, map)) = tierstore_fuzz::archive(&mut u) else {
        return;
    };
    let dir = tierstore_fuzz::check_file(&file).expect("a valid archive parses");
    assert_eq!(dir.entries.len(), map.cds.len());
    let mut mutated = file.clone();
    if tierstore_fuzz::mutate(&mut u, &mut mutated, &map).is_ok() {
        tierstore_fuzz::check_file(&mutated);
    }
});
