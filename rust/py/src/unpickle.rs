//! A fast path for torch's `weights_only` unpickler.
//!
//! `torch._weights_only_unpickler.Unpickler` is a pure-Python loop: for a
//! state dict of 20,000 small tensors it spends a second interpreting opcodes.
//! This module runs the same loop in Rust for the opcodes that torch's
//! `data.pkl` files use, with exactly torch's rules:
//!
//! - `GLOBAL` resolves only names in the allow-list the caller passes (torch's
//!   default allow-list merged with `torch.serialization.add_safe_globals`);
//! - `REDUCE` calls only objects that are values of that allow-list;
//! - `BUILD` only updates an `OrderedDict`'s `__dict__` (a state dict's
//!   `_metadata`); `APPEND(S)` only targets lists; `SETITEM(S)` only dicts,
//!   `OrderedDict`s and `Counter`s;
//! - `BINPERSID` accepts only `("storage", ...)` tuples or ints.
//!
//! Anything else — another opcode, a name outside the allow-list, a
//! blocklisted module, a sparse tensor (which torch validates afterwards),
//! malformed data — makes it give up *without side effects beyond calls to
//! allow-listed constructors*, and the caller runs torch's own unpickler from
//! the start, which then accepts the file or raises torch's exact error. So the
//! fast path never accepts what torch would refuse.

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::fastpath::{GiveUp, Stop};

/// Objects the VM compares against, fetched once per load by the caller.
pub struct Known<'py> {
    pub allowed: Bound<'py, PyDict>,
    pub allowed_values: Vec<Bound<'py, PyAny>>,
    pub blocked_modules: Vec<String>,
    pub ordered_dict: Bound<'py, PyAny>,
    pub counter: Bound<'py, PyAny>,
    /// Callables whose results torch validates after loading (sparse tensor
    /// classes); the fast path leaves those files to torch.
    pub deferred_callables: Vec<Bound<'py, PyAny>>,
    /// `(callable, stand-in)`: a REDUCE of `callable` calls `stand-in` instead
    /// (the same function without a per-call lookup). Only calls: the
    /// callable itself, as a value, stays what the file names.
    pub substitute: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
}

type Step<T> = Result<T, GiveUp>;

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Step<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or(GiveUp)?;
        let s = self.data.get(self.pos..end).ok_or(GiveUp)?;
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Step<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Step<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().map_err(|_| GiveUp)?,
        ))
    }
    fn u32(&mut self) -> Step<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| GiveUp)?,
        ))
    }
    fn line(&mut self) -> Step<&'a str> {
        let rest = self.data.get(self.pos..).ok_or(GiveUp)?;
        let n = rest.iter().position(|&b| b == b'\n').ok_or(GiveUp)?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| GiveUp)?;
        self.pos += n + 1;
        Ok(s)
    }
}

fn is_in(obj: &Bound<'_, PyAny>, set: &[Bound<'_, PyAny>]) -> bool {
    set.iter().any(|v| v.is(obj))
}

/// Deepest tuple nesting accepted (a checkpoint's deepest is a handful).
const MAX_TUPLE_DEPTH: u32 = 1000;

/// Runs `data` (a `data.pkl`) under torch's weights-only rules. `Ok(None)`
/// means "fall back to torch's unpickler".
#[allow(clippy::too_many_lines)] // one opcode per arm, as in torch's loop
pub fn load<'py>(
    py: Python<'py>,
    data: &[u8],
    known: &Known<'py>,
    persistent_load: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match run(py, data, known, persistent_load) {
        Ok(v) => Ok(Some(v)),
        Err(Stop::GiveUp) => Ok(None),
        Err(Stop::Py(e)) => Err(e),
    }
}

#[allow(clippy::too_many_lines)]
fn run<'py>(
    py: Python<'py>,
    data: &[u8],
    known: &Known<'py>,
    persistent_load: &Bound<'py, PyAny>,
) -> Result<Bound<'py, PyAny>, Stop> {
    let mut r = Reader { data, pos: 0 };
    let mut stack: Vec<Bound<'py, PyAny>> = Vec::new();
    let mut metastack: Vec<Vec<Bound<'py, PyAny>>> = Vec::new();
    let mut memo: HashMap<u32, Bound<'py, PyAny>> = HashMap::new();
    // Nesting depth of the tuples built here (by address; an address is
    // recorded when its tuple is made, so a reused one is overwritten).
    // CPython hashes nested tuples recursively without a depth guard: a
    // crafted megabyte of nested tuples used as a dict key would overflow the
    // C stack, so deeper nesting than any checkpoint holds is refused.
    let mut depth: HashMap<usize, u32> = HashMap::new();
    let mut tuple = |items: Vec<Bound<'py, PyAny>>| -> Result<Bound<'py, PyAny>, Stop> {
        let d = 1 + items
            .iter()
            .filter(|x| x.is_exact_instance_of::<PyTuple>())
            .map(|x| depth.get(&(x.as_ptr() as usize)).copied().unwrap_or(1))
            .max()
            .unwrap_or(0);
        if d > MAX_TUPLE_DEPTH {
            return Err(Stop::Py(pyo3::exceptions::PyValueError::new_err(format!(
                "tuples nested more than {MAX_TUPLE_DEPTH} deep"
            ))));
        }
        let t = PyTuple::new(py, items).map_err(Stop::Py)?.into_any();
        depth.insert(t.as_ptr() as usize, d);
        Ok(t)
    };
    let pop = |stack: &mut Vec<Bound<'py, PyAny>>| stack.pop().ok_or(GiveUp);
    let top = |stack: &Vec<Bound<'py, PyAny>>| stack.last().cloned().ok_or(GiveUp);
    let pop_mark = |stack: &mut Vec<Bound<'py, PyAny>>,
                    metastack: &mut Vec<Vec<Bound<'py, PyAny>>>| {
        let outer = metastack.pop().ok_or(GiveUp)?;
        Ok::<_, GiveUp>(std::mem::replace(stack, outer))
    };
    // Errors of Python calls made on behalf of the file are real errors
    // (torch would raise them too), except for type errors of our own making.
    let call_err = Stop::Py;
    loop {
        let op = r.u8()?;
        match op {
            0x80 => {
                // PROTO: torch warns for anything but 2; let it.
                if r.u8()? != 2 {
                    return Err(Stop::GiveUp);
                }
            }
            b'.' => return Ok(pop(&mut stack)?),
            b'(' => metastack.push(std::mem::take(&mut stack)),
            b'}' => stack.push(PyDict::new(py).into_any()),
            b']' => stack.push(PyList::empty(py).into_any()),
            b')' => stack.push(PyTuple::empty(py).into_any()),
            b'N' => stack.push(py.None().into_bound(py)),
            0x88 => stack.push(
                true.into_pyobject(py)
                    .map_err(|e| Stop::Py(e.into()))?
                    .to_owned()
                    .into_any(),
            ),
            0x89 => stack.push(
                false
                    .into_pyobject(py)
                    .map_err(|e| Stop::Py(e.into()))?
                    .to_owned()
                    .into_any(),
            ),
            b'J' => {
                let v = i32::from_le_bytes(r.take(4)?.try_into().map_err(|_| GiveUp)?);
                stack.push(
                    v.into_pyobject(py)
                        .map_err(|e| Stop::Py(e.into()))?
                        .into_any(),
                );
            }
            b'K' => stack.push(
                r.u8()?
                    .into_pyobject(py)
                    .map_err(|e| Stop::Py(e.into()))?
                    .into_any(),
            ),
            b'M' => stack.push(
                r.u16()?
                    .into_pyobject(py)
                    .map_err(|e| Stop::Py(e.into()))?
                    .into_any(),
            ),
            0x8a => {
                // LONG1: little-endian two's complement of n bytes.
                let n = usize::from(r.u8()?);
                let b = r.take(n)?;
                if n > 8 {
                    return Err(Stop::GiveUp);
                }
                let mut buf = [0u8; 8];
                buf[..n].copy_from_slice(b);
                if n > 0 && b[n - 1] & 0x80 != 0 {
                    for x in &mut buf[n..] {
                        *x = 0xff;
                    }
                }
                let v = i64::from_le_bytes(buf);
                stack.push(
                    v.into_pyobject(py)
                        .map_err(|e| Stop::Py(e.into()))?
                        .into_any(),
                );
            }
            b'G' => {
                let v = f64::from_be_bytes(r.take(8)?.try_into().map_err(|_| GiveUp)?);
                stack.push(
                    v.into_pyobject(py)
                        .map_err(|e| Stop::Py(e.into()))?
                        .into_any(),
                );
            }
            b'X' => {
                let n = r.u32()? as usize;
                let b = r.take(n)?;
                // torch decodes with "surrogatepass"; plain UTF-8 is the
                // common case, anything else goes to torch.
                let s = std::str::from_utf8(b).map_err(|_| GiveUp)?;
                stack.push(PyString::new(py, s).into_any());
            }
            b'q' => {
                let i = u32::from(r.u8()?);
                memo.insert(i, top(&stack)?);
            }
            b'r' => {
                let i = r.u32()?;
                memo.insert(i, top(&stack)?);
            }
            b'h' => {
                let i = u32::from(r.u8()?);
                stack.push(memo.get(&i).cloned().ok_or(GiveUp)?);
            }
            b'j' => {
                let i = r.u32()?;
                stack.push(memo.get(&i).cloned().ok_or(GiveUp)?);
            }
            b't' => {
                let items = pop_mark(&mut stack, &mut metastack)?;
                stack.push(tuple(items)?);
            }
            0x85 => {
                let a = pop(&mut stack)?;
                stack.push(tuple(vec![a])?);
            }
            0x86 => {
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                stack.push(tuple(vec![a, b])?);
            }
            0x87 => {
                let c = pop(&mut stack)?;
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                stack.push(tuple(vec![a, b, c])?);
            }
            b'a' => {
                let item = pop(&mut stack)?;
                let list = top(&stack)?;
                let list = list.cast_exact::<PyList>().map_err(|_| GiveUp)?;
                list.append(item).map_err(call_err)?;
            }
            b'e' => {
                let items = pop_mark(&mut stack, &mut metastack)?;
                let list = top(&stack)?;
                let list = list.cast_exact::<PyList>().map_err(|_| GiveUp)?;
                for it in items {
                    list.append(it).map_err(call_err)?;
                }
            }
            b's' | b'u' => {
                let items = if op == b's' {
                    let v = pop(&mut stack)?;
                    let k = pop(&mut stack)?;
                    vec![k, v]
                } else {
                    pop_mark(&mut stack, &mut metastack)?
                };
                let target = top(&stack)?;
                let t = target.get_type();
                let ok = target.is_exact_instance_of::<PyDict>()
                    || t.is(&known.ordered_dict)
                    || t.is(&known.counter);
                if !ok || items.len() % 2 != 0 {
                    return Err(Stop::GiveUp);
                }
                for kv in items.chunks(2) {
                    target.set_item(&kv[0], &kv[1]).map_err(call_err)?;
                }
            }
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                if known.blocked_modules.iter().any(|m| m == module) {
                    return Err(Stop::GiveUp);
                }
                let full = format!("{module}.{name}");
                let obj = known
                    .allowed
                    .get_item(&full)
                    .map_err(call_err)?
                    .ok_or(GiveUp)?;
                stack.push(obj);
            }
            b'R' => {
                let args = pop(&mut stack)?;
                let func = top(&stack)?;
                if !is_in(&func, &known.allowed_values) || is_in(&func, &known.deferred_callables) {
                    return Err(Stop::GiveUp);
                }
                let args = args.cast_exact::<PyTuple>().map_err(|_| GiveUp)?;
                let result = match &known.substitute {
                    Some((orig, stand_in)) if func.is(orig) => stand_in.call1(args),
                    _ => func.call1(args),
                }
                .map_err(call_err)?;
                let last = stack.len() - 1;
                stack[last] = result;
            }
            b'b' => {
                let state = pop(&mut stack)?;
                let inst = top(&stack)?;
                if !inst.get_type().is(&known.ordered_dict) {
                    return Err(Stop::GiveUp);
                }
                let d = inst.getattr("__dict__").map_err(call_err)?;
                d.call_method1("update", (state,)).map_err(call_err)?;
            }
            b'Q' => {
                let pid = pop(&mut stack)?;
                if let Ok(t) = pid.cast_exact::<PyTuple>() {
                    let first = t.get_item(0).map_err(|_| GiveUp)?;
                    // torch decodes bytes (and only bytes: a bytearray, list or
                    // tuple of the same values is refused there) before comparing.
                    let is_storage = first.extract::<String>().is_ok_and(|s| s == "storage")
                        || first
                            .cast::<PyBytes>()
                            .is_ok_and(|b| b.as_bytes() == b"storage");
                    if !is_storage {
                        return Err(Stop::GiveUp);
                    }
                } else {
                    return Err(Stop::GiveUp);
                }
                stack.push(persistent_load.call1((pid,)).map_err(call_err)?);
            }
            _ => return Err(Stop::GiveUp),
        }
    }
}

/// `fast_weights_only_load(data, allowed, blocked_modules, ordered_dict,
/// counter, deferred_callables, persistent_load, substitute=None)`: the
/// object, or `None` when the caller must use torch's unpickler instead.
/// `substitute`: `(callable, stand-in)`, see [`Known::substitute`].
#[pyfunction]
#[pyo3(signature = (data, allowed, blocked_modules, ordered_dict, counter, deferred_callables, persistent_load, substitute=None))]
#[allow(clippy::too_many_arguments)]
fn fast_weights_only_load<'py>(
    py: Python<'py>,
    data: &[u8],
    allowed: Bound<'py, PyDict>,
    blocked_modules: Vec<String>,
    ordered_dict: Bound<'py, PyAny>,
    counter: Bound<'py, PyAny>,
    deferred_callables: Vec<Bound<'py, PyAny>>,
    persistent_load: Bound<'py, PyAny>,
    substitute: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let allowed_values = allowed.values().iter().collect();
    let known = Known {
        allowed,
        allowed_values,
        blocked_modules,
        ordered_dict,
        counter,
        deferred_callables,
        substitute,
    };
    load(py, data, &known, &persistent_load)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fast_weights_only_load, m)?)
}
