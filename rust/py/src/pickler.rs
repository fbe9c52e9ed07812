//! A fast path for pickling `data.pkl` as `torch.save` does.
//!
//! Python's pickler calls `persistent_id` and `Tensor.__reduce_ex__` in Python
//! for every object; for a state dict of 20,000 small tensors that is most of
//! the time of a save. This module writes the same protocol-2 opcode stream
//! for the objects state dicts are made of — `None`, `bool`, `int`, `float`,
//! `str`, `tuple`, `list`, `dict`, `collections.OrderedDict` (with its
//! `__dict__`, e.g. a state dict's `_metadata`) and plain `torch.Tensor`s —
//! with the same reductions (`torch._utils._rebuild_tensor_v2`/`_v3`, the
//! storage as a persistent id) and the same memoization, so that shared and
//! repeated objects stay shared. For anything else it gives up and the caller
//! uses Python's pickler, exactly as `torch.save` would.
//!
//! The per-tensor facts (persistent id, offset, size, stride, ...) come from a
//! Python callable, `tensor_args(t)`, which returns `None` for tensors that
//! need torch's own reduction (subclasses, parameters, quantized, sparse,
//! tensors with Python state or hooks, ...).

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::fastpath::{GiveUp, Stop};

const MARK: u8 = b'(';
const BATCH: usize = 1000;
const MAX_DEPTH: usize = 500;

type Step = Result<(), Stop>;

struct Pickler<'py> {
    out: Vec<u8>,
    /// Object address -> memo index. `keep` holds every memoized object, so an
    /// address cannot be reused by a later object while we pickle (Python's
    /// pickler keeps its memo objects alive for the same reason).
    memo: HashMap<usize, u32>,
    keep: Vec<Bound<'py, PyAny>>,
    /// "module\nname" -> memo index of a GLOBAL.
    globals: HashMap<String, u32>,
    next: u32,
    tensor_type: Bound<'py, PyAny>,
    ordered_dict: Bound<'py, PyAny>,
    tensor_args: Bound<'py, PyAny>,
}

impl<'py> Pickler<'py> {
    fn put(&mut self) -> u32 {
        let i = self.next;
        self.next += 1;
        if i < 256 {
            self.out.push(b'q');
            self.out.push(i as u8);
        } else {
            self.out.push(b'r');
            self.out.extend_from_slice(&i.to_le_bytes());
        }
        i
    }

    fn get(&mut self, i: u32) {
        if i < 256 {
            self.out.push(b'h');
            self.out.push(i as u8);
        } else {
            self.out.push(b'j');
            self.out.extend_from_slice(&i.to_le_bytes());
        }
    }

    fn memoize(&mut self, obj: &Bound<'py, PyAny>) {
        let i = self.put();
        self.memo.insert(obj.as_ptr() as usize, i);
        self.keep.push(obj.clone());
    }

    fn global(&mut self, module: &str, name: &str) {
        let key = format!("{module}\n{name}");
        if let Some(&i) = self.globals.get(&key) {
            self.get(i);
            return;
        }
        self.out.push(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        let i = self.put();
        self.globals.insert(key, i);
    }

    fn int(&mut self, v: &Bound<'py, PyAny>) -> Step {
        if let Ok(n) = v.extract::<i64>() {
            if (0..256).contains(&n) {
                self.out.push(b'K');
                self.out.push(n as u8);
            } else if (0..65536).contains(&n) {
                self.out.push(b'M');
                self.out.extend_from_slice(&(n as u16).to_le_bytes());
            } else if i32::try_from(n).is_ok() {
                self.out.push(b'J');
                self.out.extend_from_slice(&(n as i32).to_le_bytes());
            } else {
                // LONG1: minimal little-endian two's complement.
                let bytes = n.to_le_bytes();
                let mut len = 8;
                while len > 1 {
                    let last = bytes[len - 1];
                    let prev_sign = bytes[len - 2] & 0x80;
                    if (last == 0 && prev_sign == 0) || (last == 0xff && prev_sign != 0) {
                        len -= 1;
                    } else {
                        break;
                    }
                }
                self.out.push(0x8a);
                self.out.push(len as u8);
                self.out.extend_from_slice(&bytes[..len]);
            }
            return Ok(());
        }
        Err(Stop::GiveUp) // beyond 64 bits: leave it to Python
    }

    fn tuple_items(&mut self, items: &[Bound<'py, PyAny>], depth: usize) -> Step {
        match items.len() {
            0 => {
                self.out.push(b')');
                return Ok(());
            }
            1..=3 => {
                for it in items {
                    self.save(it, depth + 1)?;
                }
                self.out.push([0x85, 0x86, 0x87][items.len() - 1]);
            }
            _ => {
                self.out.push(MARK);
                for it in items {
                    self.save(it, depth + 1)?;
                }
                self.out.push(b't');
            }
        }
        Ok(())
    }

    fn dict_items(
        &mut self,
        items: &[(Bound<'py, PyAny>, Bound<'py, PyAny>)],
        depth: usize,
    ) -> Step {
        for batch in items.chunks(BATCH) {
            if batch.len() == 1 {
                self.save(&batch[0].0, depth + 1)?;
                self.save(&batch[0].1, depth + 1)?;
                self.out.push(b's');
            } else {
                self.out.push(MARK);
                for (k, v) in batch {
                    self.save(k, depth + 1)?;
                    self.save(v, depth + 1)?;
                }
                self.out.push(b'u');
            }
        }
        Ok(())
    }

    fn tensor(&mut self, t: &Bound<'py, PyAny>, depth: usize) -> Step {
        let args = self.tensor_args.call1((t,))?;
        if args.is_none() {
            return Err(Stop::GiveUp);
        }
        // (v3, pid, storage_offset, size, stride, requires_grad, dtype_name)
        let a = args.cast_into::<PyTuple>().map_err(|_| GiveUp)?;
        if a.len() != 7 {
            return Err(Stop::GiveUp);
        }
        let v3: bool = a.get_item(0)?.extract()?;
        self.global(
            "torch._utils",
            if v3 {
                "_rebuild_tensor_v3"
            } else {
                "_rebuild_tensor_v2"
            },
        );
        self.out.push(MARK);
        // The storage: its persistent id, then BINPERSID.
        // ("storage", torch.<Kind>Storage, key, location, numel), saved as
        // Python's pickler saves that tuple (the class as a GLOBAL).
        let pid = a.get_item(1)?.cast_into::<PyTuple>().map_err(|_| GiveUp)?;
        if pid.len() != 5 {
            return Err(Stop::GiveUp);
        }
        let class = pid.get_item(1)?;
        let class_module: String = class.getattr("__module__")?.extract()?;
        let class_name: String = class.getattr("__qualname__")?.extract()?;
        self.out.push(MARK);
        self.save(&pid.get_item(0)?, depth + 1)?;
        self.global(&class_module, &class_name);
        for i in 2..5 {
            self.save(&pid.get_item(i)?, depth + 1)?;
        }
        self.out.push(b't');
        self.memoize(pid.as_any());
        self.out.push(b'Q');
        self.save(&a.get_item(2)?, depth + 1)?;
        self.save(&a.get_item(3)?, depth + 1)?;
        self.save(&a.get_item(4)?, depth + 1)?;
        self.save(&a.get_item(5)?, depth + 1)?;
        // backward_hooks: a fresh empty OrderedDict, as torch passes.
        self.global("collections", "OrderedDict");
        self.out.push(b')');
        self.out.push(b'R');
        self.put();
        if v3 {
            let dtype: String = a.get_item(6)?.extract()?;
            self.global("torch", &dtype);
        }
        self.out.push(b't');
        self.put(); // the args tuple
        self.out.push(b'R');
        self.memoize(t);
        Ok(())
    }

    fn save(&mut self, obj: &Bound<'py, PyAny>, depth: usize) -> Step {
        if depth > MAX_DEPTH {
            return Err(Stop::GiveUp);
        }
        if obj.is_none() {
            self.out.push(b'N');
            return Ok(());
        }
        if let Some(&i) = self.memo.get(&(obj.as_ptr() as usize)) {
            self.get(i);
            return Ok(());
        }
        let ty = obj.get_type();
        if obj.is_exact_instance_of::<PyBool>() {
            self.out.push(if obj.is_truthy()? { 0x88 } else { 0x89 });
        } else if obj.is_exact_instance_of::<PyInt>() {
            self.int(obj)?;
        } else if obj.is_exact_instance_of::<PyFloat>() {
            let v: f64 = obj.extract()?;
            self.out.push(b'G');
            self.out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(s) = obj.cast_exact::<PyString>() {
            let Ok(text) = s.to_str() else {
                return Err(Stop::GiveUp); // lone surrogates: Python's encoder decides
            };
            self.out.push(b'X');
            self.out
                .extend_from_slice(&(text.len() as u32).to_le_bytes());
            self.out.extend_from_slice(text.as_bytes());
            self.memoize(obj);
        } else if ty.is(&self.tensor_type) {
            self.tensor(obj, depth)?;
        } else if let Ok(t) = obj.cast_exact::<PyTuple>() {
            let items: Vec<Bound<'py, PyAny>> = t.iter().collect();
            if items.is_empty() {
                self.out.push(b')');
                return Ok(());
            }
            self.tuple_items(&items, depth)?;
            if self.memo.contains_key(&(obj.as_ptr() as usize)) {
                return Err(Stop::GiveUp); // a tuple reaching itself: Python's rules
            }
            self.memoize(obj);
        } else if let Ok(l) = obj.cast_exact::<PyList>() {
            self.out.push(b']');
            self.memoize(obj);
            let items: Vec<Bound<'py, PyAny>> = l.iter().collect();
            for batch in items.chunks(BATCH) {
                if batch.len() == 1 {
                    self.save(&batch[0], depth + 1)?;
                    self.out.push(b'a');
                } else {
                    self.out.push(MARK);
                    for it in batch {
                        self.save(it, depth + 1)?;
                    }
                    self.out.push(b'e');
                }
            }
        } else if let Ok(d) = obj.cast_exact::<PyDict>() {
            self.out.push(b'}');
            self.memoize(obj);
            let items: Vec<_> = d.iter().collect();
            self.dict_items(&items, depth)?;
        } else if ty.is(&self.ordered_dict) {
            // OrderedDict.__reduce__: (OrderedDict, (), vars(self) or None, None, items)
            self.global("collections", "OrderedDict");
            self.out.push(b')');
            self.out.push(b'R');
            self.memoize(obj);
            // Its own order (which move_to_end may have changed), not the dict's.
            let mut items = Vec::new();
            for kv in obj.call_method0("items")?.try_iter()? {
                let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = kv?.extract()?;
                items.push((k, v));
            }
            self.dict_items(&items, depth)?;
            let state = obj.getattr("__dict__")?;
            if state.is_truthy()? {
                let state = state.cast_into::<PyDict>().map_err(|_| GiveUp)?.copy()?;
                self.save(&state.into_any(), depth + 1)?;
                self.out.push(b'b');
            }
        } else {
            return Err(Stop::GiveUp);
        }
        Ok(())
    }
}

/// `fast_dumps(obj, tensor_type, ordered_dict, tensor_args)`: `data.pkl` for
/// `obj`, or `None` when Python's pickler must do it.
#[pyfunction]
fn fast_dumps<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    tensor_type: Bound<'py, PyAny>,
    ordered_dict: Bound<'py, PyAny>,
    tensor_args: Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let mut p = Pickler {
        out: vec![0x80, 2],
        memo: HashMap::new(),
        keep: Vec::new(),
        globals: HashMap::new(),
        next: 0,
        tensor_type,
        ordered_dict,
        tensor_args,
    };
    match p.save(obj, 0) {
        Ok(()) => {
            p.out.push(b'.');
            Ok(Some(PyBytes::new(py, &p.out)))
        }
        Err(Stop::GiveUp) => Ok(None),
        Err(Stop::Py(e)) => Err(e),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fast_dumps, m)?)
}
