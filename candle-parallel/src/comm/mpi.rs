//! The MPI backend: one process per rank (and possibly many nodes) through OpenMPI.
//!
//! Built with the cargo feature `mpi`, which needs the system packages `libopenmpi-dev`,
//! `openmpi-bin` and `libclang-dev`. Programs are started with `mpirun -np P <program>`; each
//! process calls [`MpiWorld::init`] (or [`MpiWorld::run`]) once and gets the world communicator.
//!
//! ```no_run
//! use candle_core::{Device, Tensor};
//! use candle_parallel::comm::mpi::MpiWorld;
//! use candle_parallel::comm::ReduceOp;
//!
//! // Under `mpirun -np 4`, every process prints 6.
//! let sum = MpiWorld::run(|comm| {
//!     let x = Tensor::new(&[comm.rank() as f32], &Device::Cpu)?;
//!     comm.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()
//! })
//! .unwrap();
//! println!("{}", sum[0]);
//! ```
//!
//! Semantics are those of the local backend (see [`super::Communicator`]):
//! - Reductions are a reduce-scatter then an all-gather of the flattened tensor, moved with
//!   `MPI_Alltoallv`/`MPI_Allgatherv`; the arithmetic is done by this crate, in rank order, in f32
//!   for bf16/f16 (never `MPI_Allreduce`, whose order is unspecified). Results are bit-identical
//!   on every rank and to the local backend's.
//! - Before its payload, every collective all-gathers a small metadata record (op kind,
//!   collective number, arguments, dtype, shape). A disagreement is reported as
//!   [`Error::Mismatch`] on *every* rank and no payload moves, so a mismatch never hangs or
//!   corrupts data. Argument errors (bad dim, indivisible size) are detected after that exchange,
//!   so all ranks fail together. Metadata bytes are not counted as traffic.
//! - Point-to-point messages are a header (dtype, shape) then the payload. Sends are buffered
//!   (`MPI_Isend` of a private copy), so `send` returns at once as on the local backend and
//!   send-then-recv rings cannot deadlock. A receive whose header does not match the expected
//!   shape/dtype consumes the message and returns [`Error::Mismatch`].
//! - [`Communicator::exchange`] posts its sends at once and performs its receives in
//!   [`Pending::wait`]. With OpenMPI's default progress (no progress thread), large transfers
//!   advance only while a rank is inside an MPI call, so computation between `exchange` and
//!   `wait` does not yet overlap with the transfer on this backend. Dropping a `Pending` without
//!   waiting leaves its messages queued, as on the local backend.
//! - Traffic is counted with exactly the rules of [`super::traffic`].
//! - Tensors travel as their raw bytes (contiguous, on the CPU; other devices are copied to and
//!   from the CPU). Supported dtypes: u8, u32, i16, i32, i64, bf16, f16, f32, f64, f8e4m3.
//!   One message holds at most `i32::MAX` elements (MPI counts are C ints).
//!   Received tensors of `recv`/`exchange` are on the CPU.
//!
//! Failure behaviour: MPI has no per-operation timeout here. [`MpiWorld::run`] catches an error
//! or panic of the closure, prints it naming the rank on stderr and calls `MPI_Abort` with a
//! non-zero code, which stops every rank of the job (mpirun then exits non-zero). The local
//! backend's behaviour (a configurable timeout, [`Error::PeerFailed`] naming the rank) does not
//! apply to MPI.
//!
//! Threads: MPI is initialised with `MPI_THREAD_MULTIPLE` when the library provides it, and a
//! communicator may then be used from any thread (each collective, and each header+payload pair,
//! is made atomic by a per-communicator lock). If the library provides less, every MPI call of the
//! process is serialised by one lock; a rank must then not block in one communicator while
//! another of its threads has to act for the message to arrive (`CPL_MPI_SERIALIZE=1` forces this
//! mode). `MPI_Finalize` runs when the last handle (the [`MpiWorld`] and every communicator split
//! from it) is dropped; drop them on the thread that called [`MpiWorld::init`].

use std::fmt::Display;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};
use mpi::ffi;
use mpi::Threading;

use super::rules::{
    check_dim, check_divisible, check_exchange, check_rank, chunk_bounds, concat_blocks, op_code,
    pack_chunks, panic_message, reduce_in_rank_order,
};
use super::traffic::{OpKind, Traffic};
use super::{payload_bytes, Comm, Communicator, Pending, PendingOp, RecvSpec, ReduceOp};
use crate::error::{Error, Result};

/// Marks this crate's metadata records and headers ("CPLMPI", version 1).
const MAGIC: u64 = 0x4350_4c4d_5049_0001;
/// Dimensions stored in a record; longer shapes keep the first `MAX_DIMS - 1` and a hash.
const MAX_DIMS: usize = 8;
/// Collective metadata: magic, world rank, kind, collective number, 2 args, dtype, ndim, dims.
const META_LEN: usize = 8 + MAX_DIMS;
/// Point-to-point header: magic, world rank, dtype, element count, ndim, dims.
const HDR_LEN: usize = 5 + MAX_DIMS;
const TAG_HDR: c_int = 17;
const TAG_DATA: c_int = 18;
/// Marks an absent dtype or shape in a record.
const NONE: u64 = u64::MAX;
const MPI_OK: c_int = ffi::MPI_SUCCESS as c_int;

const KINDS: [OpKind; 10] = [
    OpKind::AllReduce,
    OpKind::AllGather,
    OpKind::ReduceScatter,
    OpKind::AllToAll,
    OpKind::Broadcast,
    OpKind::Send,
    OpKind::Recv,
    OpKind::Exchange,
    OpKind::Barrier,
    OpKind::Split,
];

const DTYPES: [DType; 14] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::F8E4M3,
    DType::F6E2M3,
    DType::F6E3M2,
    DType::F4,
    DType::F8E8M0,
];

fn kind_code(k: OpKind) -> u64 {
    KINDS.iter().position(|x| *x == k).unwrap_or(KINDS.len()) as u64
}

fn kind_name(code: u64) -> &'static str {
    usize::try_from(code)
        .ok()
        .and_then(|i| KINDS.get(i))
        .map_or("unknown", |k| k.name())
}

fn dtype_code(d: DType) -> u64 {
    DTYPES.iter().position(|x| *x == d).unwrap_or(DTYPES.len()) as u64
}

fn dtype_of(code: u64) -> Option<DType> {
    usize::try_from(code)
        .ok()
        .and_then(|i| DTYPES.get(i))
        .copied()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes `ndim` then the dims (or, past `MAX_DIMS`, the first ones and a hash of all) into
/// `out`, which has `1 + MAX_DIMS` slots.
fn encode_shape(dims: &[usize], out: &mut [u64]) {
    out[0] = dims.len() as u64;
    for (slot, d) in out[1..].iter_mut().zip(dims) {
        *slot = *d as u64;
    }
    if dims.len() > MAX_DIMS {
        // FNV-1a over all dims.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for d in dims {
            h = (h ^ *d as u64).wrapping_mul(0x0100_0000_01b3);
        }
        out[MAX_DIMS] = h;
    }
}

/// Describes an encoded dtype and shape for error messages.
fn describe(dtype: u64, shape: &[u64]) -> String {
    if shape[0] == NONE {
        return "no tensor".to_string();
    }
    let dt = dtype_of(dtype).map_or_else(|| format!("dtype#{dtype}"), |d| format!("{d:?}"));
    let n = usize::try_from(shape[0]).unwrap_or(usize::MAX);
    if n <= MAX_DIMS {
        format!("{dt} {:?}", &shape[1..=n])
    } else {
        format!(
            "{dt} {:?} (+{} more dims)",
            &shape[1..MAX_DIMS],
            n - (MAX_DIMS - 1)
        )
    }
}

/// Bytes per element of the dtypes this backend can move.
fn elem_size(op: &'static str, dtype: DType) -> Result<usize> {
    match dtype {
        DType::U8
        | DType::U32
        | DType::I16
        | DType::I32
        | DType::I64
        | DType::BF16
        | DType::F16
        | DType::F32
        | DType::F64
        | DType::F8E4M3 => Ok(dtype.size_in_bytes()),
        other => Err(Error::invalid(
            op,
            format!("the MPI backend cannot transfer dtype {other:?}"),
        )),
    }
}

/// The MPI datatype moving one element of `size` bytes (an unsigned integer of that size, so
/// counts are in elements and buffers are aligned to them).
fn unit_type(size: usize) -> ffi::MPI_Datatype {
    // SAFETY: reading the constants exported by the MPI shim after MPI_Init.
    unsafe {
        match size {
            1 => ffi::RSMPI_UINT8_T,
            2 => ffi::RSMPI_UINT16_T,
            4 => ffi::RSMPI_UINT32_T,
            _ => ffi::RSMPI_UINT64_T,
        }
    }
}

fn to_count(op: &'static str, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::invalid(
            op,
            format!(
                "{n} elements exceed MPI's limit of {} elements per message",
                c_int::MAX
            ),
        )
    })
}

fn mpi_error(code: c_int, what: &str) -> Error {
    let mut buf = vec![0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer has MPI_MAX_ERROR_STRING characters, as MPI_Error_string requires.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    let msg = if rc == MPI_OK {
        let bytes: Vec<u8> = buf[..usize::try_from(len).unwrap_or(0)]
            .iter()
            .map(|c| *c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        "unknown error".to_string()
    };
    Error::Mpi(format!("{what}: {msg} (error code {code})"))
}

fn check(code: c_int, what: &str) -> Result<()> {
    if code == MPI_OK {
        Ok(())
    } else {
        Err(mpi_error(code, what))
    }
}

/// A heap buffer aligned to 8 bytes, so any element type can be read from it in place.
struct Buf {
    words: Vec<u64>,
    len: usize,
}

impl Buf {
    fn zeroed(len: usize) -> Self {
        Self {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    fn from_bytes(b: &[u8]) -> Self {
        let mut s = Self::zeroed(b.len());
        s.bytes_mut().copy_from_slice(b);
        s
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    fn ptr(&self) -> *const c_void {
        self.words.as_ptr().cast()
    }

    fn mut_ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr().cast()
    }
}

/// The bytes of elements `start..end` of a CPU storage.
fn cpu_bytes<'a>(
    op: &'static str,
    s: &'a CpuStorage,
    start: usize,
    end: usize,
) -> Result<&'a [u8]> {
    fn raw<T: candle_core::WithDType>(v: &[T]) -> &[u8] {
        // SAFETY: candle's element types are plain numbers (or newtypes of them) without padding
        // or invalid bit patterns, so their memory is `size_of_val(v)` initialised bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    Ok(match s {
        CpuStorage::U8(v) => raw(&v[start..end]),
        CpuStorage::U32(v) => raw(&v[start..end]),
        CpuStorage::I16(v) => raw(&v[start..end]),
        CpuStorage::I32(v) => raw(&v[start..end]),
        CpuStorage::I64(v) => raw(&v[start..end]),
        CpuStorage::BF16(v) => raw(&v[start..end]),
        CpuStorage::F16(v) => raw(&v[start..end]),
        CpuStorage::F32(v) => raw(&v[start..end]),
        CpuStorage::F64(v) => raw(&v[start..end]),
        CpuStorage::F8E4M3(v) => raw(&v[start..end]),
        _ => {
            return Err(Error::invalid(
                op,
                "the MPI backend cannot transfer this dtype",
            ))
        }
    })
}

/// Runs `f` on the row-major bytes of `x` (copied to the CPU and made contiguous if needed).
fn with_bytes<R>(op: &'static str, x: &Tensor, f: impl FnOnce(&[u8]) -> Result<R>) -> Result<R> {
    let x = if x.device().is_cpu() {
        x.contiguous()?
    } else {
        x.to_device(&Device::Cpu)?.contiguous()?
    };
    let (storage, layout) = x.storage_and_layout();
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| Error::invalid(op, "internal: a contiguous tensor has no offsets"))?;
    let bytes = match &*storage {
        Storage::Cpu(cpu) => cpu_bytes(op, cpu, start, end)?,
        _ => {
            return Err(Error::invalid(
                op,
                "internal: a CPU tensor is not on the CPU",
            ))
        }
    };
    f(bytes)
}

fn tensor_from_bytes(b: &[u8], dtype: DType, dims: &[usize], device: &Device) -> Result<Tensor> {
    let t = Tensor::from_raw_buffer(b, dtype, dims, &Device::Cpu)?;
    Ok(if device.is_cpu() {
        t
    } else {
        t.to_device(device)?
    })
}

/// An MPI communicator handle.
///
/// SAFETY of `Send`/`Sync`: an `MPI_Comm` is a process-wide handle, not tied to the thread that
/// created it. When MPI provides `MPI_THREAD_MULTIPLE`, any thread may use it concurrently;
/// otherwise every MPI call of this module holds [`Runtime::serial`], so no two threads are ever
/// inside MPI at once (`MPI_THREAD_SERIALIZED` use). This wrapper, rather than a `Mutex` around
/// rsmpi's `SimpleCommunicator`, keeps collectives of different communicators independent.
struct RawComm(ffi::MPI_Comm);
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// An in-flight buffered send: the request and the private copy MPI reads from.
struct OutSend {
    req: ffi::MPI_Request,
    _buf: Buf,
}
// SAFETY: as for `RawComm`; the request is only touched under the outbox lock (and the serial
// lock when MPI is not thread-multiple), and the buffer it reads is owned by the same value.
unsafe impl Send for OutSend {}

/// Process-wide MPI state shared by every communicator; finalises MPI when dropped.
struct Runtime {
    /// Present when MPI does not provide `MPI_THREAD_MULTIPLE`: held around every MPI call.
    serial: Option<Mutex<()>>,
    /// Buffered sends not known to be complete yet.
    outbox: Mutex<Vec<OutSend>>,
    threading: Threading,
    world_rank: usize,
    /// Dropping it calls `MPI_Finalize`; declared last so it drops after `Drop::drop` ran.
    _universe: mpi::environment::Universe,
}

impl Runtime {
    fn serial(&self) -> Option<MutexGuard<'_, ()>> {
        self.serial.as_ref().map(lock)
    }

    /// Forgets the buffered sends that have completed. Call with the serial lock held.
    fn reap(&self) -> Result<()> {
        let mut out = lock(&self.outbox);
        let mut i = 0;
        while i < out.len() {
            let mut flag: c_int = 0;
            // SAFETY: an active request created by MPI_Isend; its buffer is `out[i]._buf`.
            let rc = unsafe { ffi::MPI_Test(&mut out[i].req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            check(rc, "MPI_Test of a buffered send")?;
            if flag != 0 {
                out.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let _s = self.serial();
        let mut out = lock(&self.outbox);
        for mut s in out.drain(..) {
            // SAFETY: an active request whose buffer lives until the end of this iteration.
            let rc = unsafe { ffi::MPI_Wait(&mut s.req, ffi::RSMPI_STATUS_IGNORE) };
            if rc != MPI_OK {
                eprintln!(
                    "rank {}: {}",
                    self.world_rank,
                    mpi_error(rc, "completing a buffered send before MPI_Finalize")
                );
            }
        }
    }
}

/// One rank's membership of one MPI communicator.
struct CommInner {
    raw: RawComm,
    rank: usize,
    size: usize,
    world_rank: usize,
    /// Number of the next collective; held for the whole of a collective.
    coll: Mutex<u64>,
    /// Keeps the header and payload of a send together.
    send: Mutex<()>,
    /// Keeps the header and payload of a receive together.
    recv: Mutex<()>,
    rt: Arc<Runtime>,
}

impl Drop for CommInner {
    fn drop(&mut self) {
        let _s = self.rt.serial();
        // SAFETY: this communicator was created by MPI_Comm_dup/MPI_Comm_split for this value
        // only; pending operations on it complete normally after MPI_Comm_free.
        unsafe {
            ffi::MPI_Comm_free(&mut self.raw.0);
        }
    }
}

impl CommInner {
    /// Wraps a new communicator (from MPI_Comm_dup or MPI_Comm_split): sets MPI_ERRORS_RETURN so
    /// failures come back as errors, and reads its rank and size.
    fn new(raw: ffi::MPI_Comm, world_rank: usize, rt: Arc<Runtime>) -> Result<Self> {
        let mut rank: c_int = 0;
        let mut size: c_int = 0;
        let s = rt.serial();
        // SAFETY: `raw` is a valid communicator owned by the value being built.
        unsafe {
            check(
                ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN),
                "MPI_Comm_set_errhandler",
            )?;
            check(ffi::MPI_Comm_rank(raw, &mut rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(raw, &mut size), "MPI_Comm_size")?;
        }
        drop(s);
        Ok(Self {
            raw: RawComm(raw),
            rank: usize::try_from(rank).map_err(|_| Error::Mpi("negative rank".into()))?,
            size: usize::try_from(size).map_err(|_| Error::Mpi("negative size".into()))?,
            world_rank,
            coll: Mutex::new(0),
            send: Mutex::new(()),
            recv: Mutex::new(()),
            rt,
        })
    }

    fn comm(&self) -> ffi::MPI_Comm {
        self.raw.0
    }

    /// Receives one point-to-point message from `src` and checks it against the expectation.
    fn recv_one(
        &self,
        src: usize,
        shape: &Shape,
        dtype: DType,
        op: &'static str,
    ) -> Result<Tensor> {
        let src_c = to_count(op, src)?;
        let mut hdr = [0u64; HDR_LEN];
        let buf = {
            let _r = lock(&self.recv);
            let _s = self.rt.serial();
            // SAFETY: `hdr` holds HDR_LEN u64 values.
            let rc = unsafe {
                ffi::MPI_Recv(
                    hdr.as_mut_ptr().cast(),
                    HDR_LEN as c_int,
                    ffi::RSMPI_UINT64_T,
                    src_c,
                    TAG_HDR,
                    self.comm(),
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            check(rc, "MPI_Recv of a message header")?;
            if hdr[0] != MAGIC {
                return Err(Error::Mpi(format!(
                    "{op} on rank {}: corrupted message header from rank {src}",
                    self.world_rank
                )));
            }
            let sent = dtype_of(hdr[2]).ok_or_else(|| {
                Error::Mpi(format!("{op}: unknown dtype code {} in a header", hdr[2]))
            })?;
            let el = sent.size_in_bytes().max(1);
            let count = usize::try_from(hdr[3]).unwrap_or(usize::MAX);
            let mut buf = Buf::zeroed(count * el);
            // SAFETY: `buf` holds `count` elements of `el` bytes, 8-byte aligned.
            let rc = unsafe {
                ffi::MPI_Recv(
                    buf.mut_ptr(),
                    to_count(op, count)?,
                    unit_type(el),
                    src_c,
                    TAG_DATA,
                    self.comm(),
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            check(rc, "MPI_Recv of a message payload")?;
            buf
        };
        let mut expect = [0u64; 1 + MAX_DIMS];
        encode_shape(shape.dims(), &mut expect);
        if hdr[2] != dtype_code(dtype) || hdr[4..] != expect[..] {
            return Err(Error::Mismatch {
                op,
                me: self.world_rank,
                peer: usize::try_from(hdr[1]).unwrap_or(usize::MAX),
                msg: format!(
                    "expected {dtype:?} {:?}, received {}",
                    shape.dims(),
                    describe(hdr[2], &hdr[4..])
                ),
            });
        }
        tensor_from_bytes(buf.bytes(), dtype, shape.dims(), &Device::Cpu)
    }
}

/// One rank's handle on one MPI communicator (the world or a split of it).
pub struct MpiComm {
    inner: Arc<CommInner>,
    traffic: Traffic,
}

impl MpiComm {
    /// The all-to-all of `x`'s `p` chunks along `dim` (chunk `j` to rank `j`): the received
    /// chunks in rank order, flattened `(n,)` on the CPU, with the chunk length `m` and the
    /// element size. Inside a [`MpiComm::collective`].
    fn alltoall_chunks(
        &self,
        name: &'static str,
        x: &Tensor,
        dim: usize,
    ) -> Result<(Tensor, usize, usize)> {
        let el = elem_size(name, x.dtype())?;
        let p = self.inner.size;
        let n = x.elem_count();
        to_count(name, n)?;
        let m = n / p;
        let count = to_count(name, m)?;
        let unit = unit_type(el);
        let comm = self.inner.comm();
        let packed = pack_chunks(x, dim, p)?;
        let mut recv = Buf::zeroed(n * el);
        with_bytes(name, &packed, |b| {
            // SAFETY: `b` and `recv` hold p * m elements.
            let rc = self.locked(|| unsafe {
                ffi::MPI_Alltoall(
                    b.as_ptr().cast(),
                    count,
                    unit,
                    recv.mut_ptr(),
                    count,
                    unit,
                    comm,
                )
            });
            check(rc, "MPI_Alltoall")
        })?;
        let flat = tensor_from_bytes(recv.bytes(), x.dtype(), &[n], &Device::Cpu)?;
        Ok((flat, m, el))
    }

    /// Runs `f`, an MPI call, under the serial lock when MPI is not thread-multiple.
    fn locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let _s = self.inner.rt.serial();
        f()
    }

    /// Runs one collective: exchanges and checks the metadata records of every rank, then runs
    /// `body` with them, all under the communicator's collective lock.
    fn collective<R>(
        &self,
        kind: OpKind,
        args: [u64; 2],
        compare_args: bool,
        tensor: Option<(&Shape, DType)>,
        body: impl FnOnce(&[[u64; META_LEN]]) -> Result<R>,
    ) -> Result<R> {
        let inner = &*self.inner;
        let mut seq = lock(&inner.coll);
        let mut mine = [0u64; META_LEN];
        mine[0] = MAGIC;
        mine[1] = inner.world_rank as u64;
        mine[2] = kind_code(kind);
        mine[3] = *seq;
        mine[4] = args[0];
        mine[5] = args[1];
        match tensor {
            Some((shape, dtype)) => {
                mine[6] = dtype_code(dtype);
                encode_shape(shape.dims(), &mut mine[7..]);
            }
            None => {
                mine[6] = NONE;
                mine[7..].fill(NONE);
            }
        }
        *seq += 1;
        let mut all = vec![[0u64; META_LEN]; inner.size];
        // SAFETY: `mine` holds META_LEN u64 values and `all` size * META_LEN.
        let rc = self.locked(|| unsafe {
            ffi::MPI_Allgather(
                mine.as_ptr().cast(),
                META_LEN as c_int,
                ffi::RSMPI_UINT64_T,
                all.as_mut_ptr().cast(),
                META_LEN as c_int,
                ffi::RSMPI_UINT64_T,
                inner.comm(),
            )
        });
        check(rc, "MPI_Allgather of collective metadata")?;
        for (r, theirs) in all.iter().enumerate() {
            if r == inner.rank {
                continue;
            }
            if theirs[0] != MAGIC {
                return Err(Error::Mpi(format!(
                    "{} on rank {}: corrupted metadata from rank {r} of the communicator",
                    kind.name(),
                    inner.world_rank
                )));
            }
            let mismatch = |msg: String| Error::Mismatch {
                op: kind.name(),
                me: inner.world_rank,
                peer: usize::try_from(theirs[1]).unwrap_or(usize::MAX),
                msg,
            };
            if theirs[2..4] != mine[2..4] {
                return Err(mismatch(format!(
                    "this rank is in collective #{} ({}), the peer is in collective #{} ({})",
                    mine[3],
                    kind_name(mine[2]),
                    theirs[3],
                    kind_name(theirs[2])
                )));
            }
            if compare_args && theirs[4..6] != mine[4..6] {
                return Err(mismatch(format!(
                    "arguments differ: this rank passed {:?}, the peer passed {:?}",
                    &mine[4..6],
                    &theirs[4..6]
                )));
            }
            if theirs[6..] != mine[6..] {
                return Err(mismatch(format!(
                    "this rank has {}, the peer has {}",
                    describe(mine[6], &mine[7..]),
                    describe(theirs[6], &theirs[7..])
                )));
            }
        }
        body(&all)
    }

    /// Buffered send of a header and a private copy of `x` to `dst`.
    fn post_send(&self, op: &'static str, x: &Tensor, dst: usize) -> Result<()> {
        let el = elem_size(op, x.dtype())?;
        let n = x.elem_count();
        let count = to_count(op, n)?;
        let dst_c = to_count(op, dst)?;
        let mut hdr = Buf::zeroed(HDR_LEN * 8);
        hdr.words[0] = MAGIC;
        hdr.words[1] = self.inner.world_rank as u64;
        hdr.words[2] = dtype_code(x.dtype());
        hdr.words[3] = n as u64;
        encode_shape(x.dims(), &mut hdr.words[4..]);
        let payload = with_bytes(op, x, |b| Ok(Buf::from_bytes(b)))?;
        debug_assert_eq!(payload.len, n * el);
        let inner = &*self.inner;
        let _g = lock(&inner.send);
        let _s = inner.rt.serial();
        // SAFETY: both buffers are moved into the outbox right after, which keeps their heap
        // memory alive and unmoved until MPI reports the sends complete.
        unsafe {
            let mut reqs = [ffi::RSMPI_REQUEST_NULL; 2];
            check(
                ffi::MPI_Isend(
                    hdr.ptr(),
                    HDR_LEN as c_int,
                    ffi::RSMPI_UINT64_T,
                    dst_c,
                    TAG_HDR,
                    inner.comm(),
                    &mut reqs[0],
                ),
                "MPI_Isend of a message header",
            )?;
            let rc = ffi::MPI_Isend(
                payload.ptr(),
                count,
                unit_type(el),
                dst_c,
                TAG_DATA,
                inner.comm(),
                &mut reqs[1],
            );
            let mut out = lock(&inner.rt.outbox);
            out.push(OutSend {
                req: reqs[0],
                _buf: hdr,
            });
            check(rc, "MPI_Isend of a message payload")?;
            out.push(OutSend {
                req: reqs[1],
                _buf: payload,
            });
        }
        inner.rt.reap()
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size
    }

    fn world_rank(&self) -> usize {
        self.inner.world_rank
    }

    fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_reduce");
        let kind = OpKind::AllReduce;
        let name = kind.name();
        let meta = Some((x.shape(), x.dtype()));
        self.collective(kind, [op_code(op) as u64, 0], true, meta, |_| {
            let el = elem_size(name, x.dtype())?;
            let p = self.inner.size;
            let me = self.inner.rank;
            let n = x.elem_count();
            to_count(name, n)?;
            // Chunk j (of ceil/floor size) is reduced by rank j, as on the local backend.
            let bounds = chunk_bounds(n, p);
            let counts = bounds
                .iter()
                .map(|&(_, l)| to_count(name, l))
                .collect::<Result<Vec<_>>>()?;
            let displs = bounds
                .iter()
                .map(|&(s, _)| to_count(name, s))
                .collect::<Result<Vec<_>>>()?;
            let m = bounds[me].1;
            to_count(name, m * p)?;
            let rcounts = vec![counts[me]; p];
            let rdispls = (0..p)
                .map(|r| to_count(name, r * m))
                .collect::<Result<Vec<_>>>()?;
            let unit = unit_type(el);
            let comm = self.inner.comm();
            // Reduce-scatter: chunk j goes to rank j.
            let mut gathered = Buf::zeroed(m * p * el);
            with_bytes(name, x, |b| {
                // SAFETY: counts and displacements stay within `b` (n elements) and
                // `gathered` (p * m elements).
                let rc = self.locked(|| unsafe {
                    ffi::MPI_Alltoallv(
                        b.as_ptr().cast(),
                        counts.as_ptr(),
                        displs.as_ptr(),
                        unit,
                        gathered.mut_ptr(),
                        rcounts.as_ptr(),
                        rdispls.as_ptr(),
                        unit,
                        comm,
                    )
                });
                check(rc, "MPI_Alltoallv (all_reduce)")
            })?;
            let flat = tensor_from_bytes(gathered.bytes(), x.dtype(), &[m * p], &Device::Cpu)?;
            let parts = (0..p)
                .map(|r| flat.narrow(0, r * m, m))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let reduced = reduce_in_rank_order(&parts, op, p)?;
            // All-gather of the reduced chunks.
            let mut full = Buf::zeroed(n * el);
            with_bytes(name, &reduced, |b| {
                // SAFETY: `b` holds m elements; `full` n, laid out by counts/displs.
                let rc = self.locked(|| unsafe {
                    ffi::MPI_Allgatherv(
                        b.as_ptr().cast(),
                        counts[me],
                        unit,
                        full.mut_ptr(),
                        counts.as_ptr(),
                        displs.as_ptr(),
                        unit,
                        comm,
                    )
                });
                check(rc, "MPI_Allgatherv (all_reduce)")
            })?;
            let out = tensor_from_bytes(full.bytes(), x.dtype(), x.dims(), x.device())?;
            self.traffic.record_all_reduce(&bounds, me, el as u64);
            Ok(out)
        })
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_gather");
        let kind = OpKind::AllGather;
        let name = kind.name();
        let meta = Some((x.shape(), x.dtype()));
        self.collective(kind, [dim as u64, 0], true, meta, |_| {
            check_dim(name, x, dim)?;
            let el = elem_size(name, x.dtype())?;
            let p = self.inner.size;
            let n = x.elem_count();
            let count = to_count(name, n)?;
            let unit = unit_type(el);
            let comm = self.inner.comm();
            let mut all = Buf::zeroed(n * p * el);
            with_bytes(name, x, |b| {
                // SAFETY: `b` holds n elements, `all` p * n.
                let rc = self.locked(|| unsafe {
                    ffi::MPI_Allgather(
                        b.as_ptr().cast(),
                        count,
                        unit,
                        all.mut_ptr(),
                        count,
                        unit,
                        comm,
                    )
                });
                check(rc, "MPI_Allgather")
            })?;
            let flat = tensor_from_bytes(all.bytes(), x.dtype(), &[n * p], &Device::Cpu)?;
            let out = concat_blocks(&flat, x.dims(), p, dim)?;
            let out = if x.device().is_cpu() {
                out
            } else {
                out.to_device(x.device())?
            };
            let b = payload_bytes(x) * (p as u64 - 1);
            self.traffic.record(kind, b, b);
            Ok(out)
        })
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("reduce_scatter");
        let kind = OpKind::ReduceScatter;
        let name = kind.name();
        let meta = Some((x.shape(), x.dtype()));
        self.collective(kind, [dim as u64, op_code(op) as u64], true, meta, |_| {
            check_dim(name, x, dim)?;
            let c = check_divisible(name, x, dim, self.inner.size)?;
            let p = self.inner.size;
            let (flat, m, el) = self.alltoall_chunks(name, x, dim)?;
            let parts = (0..p)
                .map(|r| flat.narrow(0, r * m, m))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let mut dims = x.dims().to_vec();
            dims[dim] = c;
            let out = reduce_in_rank_order(&parts, op, p)?.reshape(dims)?;
            let out = if x.device().is_cpu() {
                out
            } else {
                out.to_device(x.device())?
            };
            self.traffic.record_symmetric(kind, (m * el) as u64, p);
            Ok(out)
        })
    }

    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_to_all");
        let kind = OpKind::AllToAll;
        let name = kind.name();
        let meta = Some((x.shape(), x.dtype()));
        let args = [split_dim as u64, concat_dim as u64];
        self.collective(kind, args, true, meta, |_| {
            check_dim(name, x, split_dim)?;
            check_dim(name, x, concat_dim)?;
            let c = check_divisible(name, x, split_dim, self.inner.size)?;
            let p = self.inner.size;
            let (flat, m, el) = self.alltoall_chunks(name, x, split_dim)?;
            let mut piece = x.dims().to_vec();
            piece[split_dim] = c;
            let out = concat_blocks(&flat, &piece, p, concat_dim)?;
            let out = if x.device().is_cpu() {
                out
            } else {
                out.to_device(x.device())?
            };
            self.traffic.record_symmetric(kind, (m * el) as u64, p);
            Ok(out)
        })
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("broadcast");
        let kind = OpKind::Broadcast;
        let name = kind.name();
        let meta = Some((x.shape(), x.dtype()));
        self.collective(kind, [root as u64, 0], true, meta, |_| {
            check_rank(name, "root", root, self.inner.size)?;
            let el = elem_size(name, x.dtype())?;
            let p = self.inner.size;
            let n = x.elem_count();
            let count = to_count(name, n)?;
            let root_c = to_count(name, root)?;
            let unit = unit_type(el);
            let comm = self.inner.comm();
            let b = payload_bytes(x);
            if self.inner.rank == root {
                with_bytes(name, x, |bytes| {
                    // SAFETY: MPI_Bcast only reads the root's buffer (n elements); the cast to
                    // a mutable pointer is required by the C signature, nothing writes to it.
                    let rc = self.locked(|| unsafe {
                        ffi::MPI_Bcast(bytes.as_ptr() as *mut c_void, count, unit, root_c, comm)
                    });
                    check(rc, "MPI_Bcast")
                })?;
                self.traffic.record(kind, b * (p as u64 - 1), 0);
                Ok(x.detach().contiguous()?)
            } else {
                let mut buf = Buf::zeroed(n * el);
                // SAFETY: `buf` holds n elements.
                let rc = self
                    .locked(|| unsafe { ffi::MPI_Bcast(buf.mut_ptr(), count, unit, root_c, comm) });
                check(rc, "MPI_Bcast")?;
                self.traffic.record(kind, 0, b);
                tensor_from_bytes(buf.bytes(), x.dtype(), x.dims(), x.device())
            }
        })
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let _comm = super::traffic::CommTimer::start("send");
        let kind = OpKind::Send;
        check_rank(kind.name(), "destination", dst, self.inner.size)?;
        self.post_send(kind.name(), x, dst)?;
        self.traffic.record_send(x, self.inner.rank, dst);
        Ok(())
    }

    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("recv");
        let kind = OpKind::Recv;
        check_rank(kind.name(), "source", src, self.inner.size)?;
        let t = self.inner.recv_one(src, shape, dtype, kind.name())?;
        self.traffic.record_recv(&t, self.inner.rank, src);
        Ok(t)
    }

    fn exchange(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Pending> {
        let _comm = super::traffic::CommTimer::start("exchange");
        check_exchange(&sends, &recvs, self.inner.size)?;
        for (dst, t) in &sends {
            self.post_send(OpKind::Exchange.name(), t, *dst)?;
        }
        self.traffic
            .record_exchange(&sends, &recvs, self.inner.rank);
        Ok(Pending::new(Box::new(MpiPending {
            inner: self.inner.clone(),
            recvs,
        })))
    }

    fn barrier(&self) -> Result<()> {
        let _comm = super::traffic::CommTimer::start("barrier");
        let kind = OpKind::Barrier;
        // The metadata all-gather completes on no rank before every rank has joined it.
        self.collective(kind, [0, 0], true, None, |_| Ok(()))?;
        self.traffic.record(kind, 0, 0);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Comm> {
        let kind = OpKind::Split;
        let args = [color as u64, key as u64];
        self.collective(kind, args, false, None, |all| {
            let inner = &*self.inner;
            let me = inner.rank;
            let pairs: Vec<(usize, usize)> =
                all.iter().map(|m| (m[4] as usize, m[5] as usize)).collect();
            let plan = super::plan_split(&pairs, me)?;
            let (pos, group) = (plan.rank, plan.members);
            // MPI colors and keys are C ints: pass the index of the color among the distinct
            // colors, and the position in the (key, rank) order.
            let mut colors: Vec<u64> = all.iter().map(|m| m[4]).collect();
            colors.sort_unstable();
            colors.dedup();
            let color_idx = colors.iter().position(|&c| c == color as u64).unwrap_or(0);
            let (color_c, key_c) = (to_count("split", color_idx)?, to_count("split", pos)?);
            let mut raw = unsafe { ffi::RSMPI_COMM_NULL };
            // SAFETY: every rank of the communicator calls MPI_Comm_split here, after the same
            // successful metadata exchange.
            let rc = self
                .locked(|| unsafe { ffi::MPI_Comm_split(inner.comm(), color_c, key_c, &mut raw) });
            check(rc, "MPI_Comm_split")?;
            let new = CommInner::new(raw, inner.world_rank, inner.rt.clone())?;
            if new.rank != pos || new.size != group.len() {
                return Err(Error::Mpi(format!(
                    "MPI_Comm_split gave rank {} of {}, expected {pos} of {}",
                    new.rank,
                    new.size,
                    group.len()
                )));
            }
            self.traffic.record(kind, 0, 0);
            let comm: Comm = Arc::new(MpiComm {
                inner: Arc::new(new),
                traffic: self.traffic.clone(),
            });
            Ok(comm)
        })
    }
}

struct MpiPending {
    inner: Arc<CommInner>,
    recvs: Vec<RecvSpec>,
}

impl PendingOp for MpiPending {
    fn wait(self: Box<Self>) -> Result<Vec<Tensor>> {
        self.recvs
            .iter()
            .map(|r| {
                self.inner
                    .recv_one(r.src, &r.shape, r.dtype, OpKind::Exchange.name())
            })
            .collect()
    }
}

/// This process's membership of an MPI job: initialises MPI and owns the world communicator.
pub struct MpiWorld {
    comm: Arc<MpiComm>,
}

impl MpiWorld {
    /// Initialises MPI (asking for `MPI_THREAD_MULTIPLE`) and builds the world communicator
    /// (a duplicate of `MPI_COMM_WORLD`, so this crate's messages never meet other MPI code's).
    /// Fails if MPI was already initialised in this process: call it once per process.
    pub fn init() -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                Error::Mpi(
                    "MPI is already initialised in this process (MpiWorld::init may be called \
                     once per process)"
                        .into(),
                )
            })?;
        let mut world_rank: c_int = 0;
        // SAFETY: MPI is initialised; COMM_WORLD is valid.
        check(
            unsafe { ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut world_rank) },
            "MPI_Comm_rank",
        )?;
        let world_rank =
            usize::try_from(world_rank).map_err(|_| Error::Mpi("negative world rank".into()))?;
        let rt = Arc::new(Runtime {
            serial: (threading != Threading::Multiple || serialise_forced())
                .then(|| Mutex::new(())),
            outbox: Mutex::new(Vec::new()),
            threading,
            world_rank,
            _universe: universe,
        });
        let mut raw = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: MPI is initialised; the duplicate is owned by the CommInner built below.
        check(
            unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut raw) },
            "MPI_Comm_dup",
        )?;
        let inner = CommInner::new(raw, world_rank, rt)?;
        Ok(Self {
            comm: Arc::new(MpiComm {
                inner: Arc::new(inner),
                traffic: Traffic::new(),
            }),
        })
    }

    /// The world communicator of this rank.
    pub fn comm(&self) -> Comm {
        self.comm.clone()
    }

    /// This process's rank in the world.
    pub fn rank(&self) -> usize {
        self.comm.inner.rank
    }

    /// Number of processes in the job.
    pub fn size(&self) -> usize {
        self.comm.inner.size
    }

    /// Whether MPI calls may run concurrently: MPI provided `MPI_THREAD_MULTIPLE` and
    /// `CPL_MPI_SERIALIZE=1` is not set (otherwise MPI calls are serialised by one lock).
    pub fn thread_multiple(&self) -> bool {
        self.comm.inner.rt.threading == Threading::Multiple && self.comm.inner.rt.serial.is_none()
    }

    /// Stops every rank of the job with `MPI_Abort(MPI_COMM_WORLD, code)`.
    pub fn abort(&self, code: i32) -> ! {
        abort_job(code)
    }

    /// Initialises MPI and runs `f` with this rank's world communicator; returns its value after
    /// finalising MPI (when `f` kept no communicator). Errors only if MPI cannot be initialised.
    ///
    /// Failure behaviour: if `f` returns an error or panics, the error is printed to stderr
    /// naming the rank and the whole job is stopped with `MPI_Abort` (exit code 1): every rank
    /// stops, and mpirun exits non-zero.
    pub fn run<T, E, F>(f: F) -> Result<T>
    where
        E: Display,
        F: FnOnce(Comm) -> std::result::Result<T, E>,
    {
        Ok(Self::init()?.launch(f))
    }

    /// As [`MpiWorld::run`], on an initialised world.
    pub fn launch<T, E, F>(self, f: F) -> T
    where
        E: Display,
        F: FnOnce(Comm) -> std::result::Result<T, E>,
    {
        let rank = self.rank();
        let reason = match catch_unwind(AssertUnwindSafe(|| f(self.comm()))) {
            Ok(Ok(v)) => {
                drop(self);
                return v;
            }
            Ok(Err(e)) => e.to_string(),
            Err(payload) => format!("panicked: {}", panic_message(&payload)),
        };
        eprintln!("rank {rank} failed: {reason}");
        eprintln!("rank {rank}: calling MPI_Abort to stop every rank of the job");
        abort_job(1)
    }
}

/// `CPL_MPI_SERIALIZE=1` serialises MPI calls even under `MPI_THREAD_MULTIPLE` (to test that
/// path, or to work around an MPI library whose thread support is unreliable).
fn serialise_forced() -> bool {
    std::env::var("CPL_MPI_SERIALIZE").is_ok_and(|v| v == "1")
}

fn abort_job(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: MPI_Abort may be called at any time after MPI_Init.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
    std::process::exit(if code == 0 { 1 } else { code })
}
