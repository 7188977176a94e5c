//! The NCCL communicator: the [`Communicator`] contract on CUDA tensors, through cudarc's NCCL
//! bindings (candle-core's `nccl` feature). One process per GPU; see [`super::nccl_bootstrap`]
//! for how ranks find each other and how mesh sub-groups get their own communicators.
//!
//! Status: compile-checked in CI; it has not run on a GPU yet (see `docs/gpu.md`).
//!
//! Every operation is built from one primitive, a grouped send/recv of byte buffers
//! (NCCL's `groupStart`/`send`/`recv`/`groupEnd`), by [`super::p2p`], whose collectives are
//! tested on CPU against the local backend bit for bit; candle ops on the device chunk and
//! reduce. In particular the reductions are NOT NCCL's own
//! `ncclAllReduce`/`ncclReduceScatter`: the chunks are exchanged (all-to-all), combined in rank
//! order in f32 for half-precision inputs ([`super::rules::reduce_in_rank_order`], the same
//! arithmetic as the local and MPI backends) and gathered back. That moves the same bytes as a
//! ring all-reduce (`2 (P-1) N / P` per rank) and gives the same bits as the other backends and
//! from run to run, which NCCL's reductions do not promise (their order depends on the
//! algorithm NCCL picks). The traffic is recorded by the shared counting rules.
//!
//! NCCL calls are enqueued on candle's CUDA stream of the device, so they are ordered with the
//! kernels that produce and consume the tensors; [`Communicator::barrier`] also synchronises
//! the stream. CPU tensors passed to a collective (a training loop's loss and token counts) are
//! staged through the device and the result comes back on the CPU. Failures: an NCCL error is returned as [`Error::Nccl`] naming the call; a peer
//! that dies mid-collective is not detected by NCCL's blocking calls, so under `mpirun` the
//! launcher's abort (as with the MPI backend) is what stops the job.

use std::os::raw::c_char;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::backend::BackendDevice;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use candle_core::cuda::cudarc::nccl::result as nccl_result;
use candle_core::cuda::cudarc::nccl::safe::{Comm as RawNccl, Id};
use candle_core::cuda::CudaDevice;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Shape, Storage, Tensor};

use super::nccl_bootstrap::{publish_id, split_ids, wait_for_id, UniqueId, ID_BYTES};
use super::p2p::{self, GroupedP2p};
use super::rules::{check_exchange, check_rank, chunk_bounds};
use super::traffic::{OpKind, Traffic};
use super::{payload_bytes, Comm, Communicator, Pending, PendingOp, RecvSpec, ReduceOp};
use crate::error::{Error, Result};

/// An NCCL communicator handle.
///
/// SAFETY of `Send`/`Sync`: an NCCL communicator may be used from any thread, but not by two
/// threads at once; every use goes through the mutex.
struct Raw(Mutex<RawNccl>);
unsafe impl Send for Raw {}
unsafe impl Sync for Raw {}

/// A rank of an NCCL communicator, on one CUDA device.
pub struct NcclComm {
    raw: Raw,
    dev: CudaDevice,
    rank: usize,
    size: usize,
    world_rank: usize,
    traffic: Traffic,
}

fn nccl_err(call: &str, e: impl std::fmt::Debug) -> Error {
    Error::Nccl(format!("{call}: {e:?}"))
}

/// A new NCCL unique id (`ncclGetUniqueId`), as bytes.
pub fn new_id() -> Result<UniqueId> {
    let id = Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal().map(|c| c as u8))
}

fn id_from_bytes(id: &UniqueId) -> Id {
    let mut internal: [c_char; ID_BYTES] = [0; ID_BYTES];
    for (d, s) in internal.iter_mut().zip(id) {
        *d = *s as c_char;
    }
    Id::uninit(internal)
}

impl NcclComm {
    /// Rank `rank` of a world of `size` ranks on `dev`, all initialised with the same `id`
    /// (collective: every rank of the world calls it).
    pub fn world(dev: &CudaDevice, rank: usize, size: usize, id: &UniqueId) -> Result<Comm> {
        check_rank("nccl world", "rank", rank, size)?;
        let raw = RawNccl::from_rank(dev.cuda_stream(), rank, size, id_from_bytes(id))
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Arc::new(NcclComm {
            raw: Raw(Mutex::new(raw)),
            dev: dev.clone(),
            rank,
            size,
            world_rank: rank,
            traffic: Traffic::new(),
        }))
    }

    /// [`NcclComm::world`] with the id exchanged through the rendezvous file `path`: rank 0
    /// creates and publishes it, the others wait up to `timeout` for it.
    pub fn from_rendezvous(
        dev: &CudaDevice,
        rank: usize,
        size: usize,
        path: &Path,
        timeout: Duration,
    ) -> Result<Comm> {
        let id = if rank == 0 {
            let id = new_id()?;
            publish_id(path, &id)?;
            id
        } else {
            wait_for_id(path, timeout)?
        };
        Self::world(dev, rank, size, &id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RawNccl> {
        self.raw.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn device(&self) -> Device {
        Device::Cuda(self.dev.clone())
    }

    /// The tensor on this communicator's device, contiguous. CPU tensors (the few scalars a
    /// training loop reduces, such as losses and token counts) are staged through the device;
    /// the operations return their results on the caller's device ([`NcclComm::home`]).
    fn on_device(&self, op: &'static str, x: &Tensor) -> Result<Tensor> {
        match x.device() {
            Device::Cuda(d) if d.same_device(&self.dev) => Ok(x.detach().contiguous()?),
            Device::Cpu => Ok(x.detach().to_device(&self.device())?.contiguous()?),
            other => Err(Error::invalid(
                op,
                format!(
                    "the NCCL communicator works on its CUDA device (or stages CPU tensors), got \
                     a tensor on {:?}",
                    other.location()
                ),
            )),
        }
    }

    /// `out` on `home`, the device of the caller's input.
    fn home(out: Tensor, home: &Device) -> Result<Tensor> {
        Ok(if home.is_cpu() {
            out.to_device(home)?
        } else {
            out
        })
    }

    /// Every NCCL call is enqueued on the device's one stream (`cpl` opens its GPUs with
    /// `CudaDevice::new_with_stream`, shared by every user), so stream order alone orders the
    /// messages with the kernels around them.
    ///
    /// Posts every send and receive (to and from other ranks) as one NCCL group and returns
    /// the received tensors, in the order of `recvs`. Empty messages travel nowhere (an empty
    /// receive is an empty view, never a zero-byte allocation). The group is opened and closed
    /// here (`ncclGroupStart`/`ncclGroupEnd`, not cudarc's `Group`, whose drop panics on an
    /// error), so an NCCL failure is returned as [`Error::Nccl`].
    fn group_p2p(&self, sends: &[(usize, Tensor)], recvs: &[RecvSpec]) -> Result<Vec<Tensor>> {
        if sends.iter().any(|(d, _)| *d == self.rank) || recvs.iter().any(|r| r.src == self.rank) {
            return Err(Error::invalid(
                "exchange",
                "internal: NCCL groups only carry messages between different ranks",
            ));
        }
        let sends: Vec<(usize, Tensor)> = sends
            .iter()
            .filter(|(_, t)| t.elem_count() > 0)
            .map(|(d, t)| Ok((*d, self.on_device("exchange", t)?)))
            .collect::<Result<_>>()?;
        // One buffer per non-empty receive; an empty one is a view of a one-element buffer.
        let mut bufs: Vec<CudaStorage> = recvs
            .iter()
            .map(|r| alloc(&self.dev, r.dtype, r.shape.elem_count().max(1)))
            .collect::<Result<_>>()?;
        {
            let guards: Vec<_> = sends.iter().map(|(_, t)| t.storage_and_layout()).collect();
            let mut send_views: Vec<(usize, CudaView<'_, u8>)> = Vec::new();
            for ((dst, t), (st, l)) in sends.iter().zip(&guards) {
                let cs = match &**st {
                    Storage::Cuda(cs) => cs,
                    _ => return Err(Error::invalid("exchange", "internal: not a CUDA tensor")),
                };
                send_views.push((*dst, bytes(cs, l.start_offset(), t.elem_count())?));
            }
            let mut recv_views: Vec<(usize, CudaViewMut<'_, u8>)> = Vec::new();
            for (r, buf) in recvs.iter().zip(bufs.iter_mut()) {
                if r.shape.elem_count() > 0 {
                    recv_views.push((r.src, bytes_mut(buf)?));
                }
            }
            let raw = self.lock();
            nccl_result::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
            let posted = (|| -> Result<()> {
                for (dst, v) in &send_views {
                    raw.send(v, peer(*dst)?)
                        .map_err(|e| nccl_err("ncclSend", e))?;
                }
                for (src, v) in recv_views.iter_mut() {
                    raw.recv(v, peer(*src)?)
                        .map_err(|e| nccl_err("ncclRecv", e))?;
                }
                Ok(())
            })();
            // Always close the group, also after a failed post.
            let ended = nccl_result::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
            posted?;
            ended?;
        }
        recvs
            .iter()
            .zip(bufs)
            .map(|(r, buf)| {
                let n = r.shape.elem_count();
                let t =
                    Tensor::from_storage(Storage::Cuda(buf), n.max(1), BackpropOp::none(), false);
                Ok(t.narrow(0, 0, n)?.reshape(r.shape.clone())?)
            })
            .collect()
    }
}

impl GroupedP2p for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn group(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Vec<Tensor>> {
        self.group_p2p(&sends, &recvs)
    }
}

/// The NCCL peer index.
fn peer(r: usize) -> Result<i32> {
    i32::try_from(r).map_err(|_| Error::invalid("nccl", format!("rank {r} does not fit NCCL")))
}

/// Runs `$body` with `$T` the element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            other => {
                return Err(Error::invalid(
                    "nccl",
                    format!("dtype {other:?} is not supported by the NCCL communicator"),
                ))
            }
        }
    };
}

/// A new zeroed CUDA buffer of `n` elements of `dtype`.
fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    by_dtype!(dtype, T => {
        let s: CudaSlice<T> = dev.alloc_zeros::<T>(n)?;
        Ok(CudaStorage::wrap_cuda_slice(s, dev.clone()))
    })
}

/// Elements `off..off + n` of `cs` as bytes.
fn bytes(cs: &CudaStorage, off: usize, n: usize) -> Result<CudaView<'_, u8>> {
    let dtype = candle_core::backend::BackendStorage::dtype(cs);
    let size = dtype.size_in_bytes();
    by_dtype!(dtype, T => {
        let s: &CudaSlice<T> = cs.as_cuda_slice::<T>()?;
        let v = s
            .try_slice(off..off + n)
            .ok_or_else(|| Error::invalid("nccl", "internal: tensor view out of its buffer"))?;
        // SAFETY: a view of n elements of size `size` covers exactly n * size bytes; u8 has no
        // alignment or validity requirement.
        unsafe { v.transmute::<u8>(n * size) }
            .ok_or_else(|| Error::invalid("nccl", "internal: byte view out of range"))
    })
}

/// The whole of `cs` as mutable bytes.
fn bytes_mut(cs: &mut CudaStorage) -> Result<CudaViewMut<'_, u8>> {
    let dtype = candle_core::backend::BackendStorage::dtype(cs);
    let size = dtype.size_in_bytes();
    by_dtype!(dtype, T => {
        let s: &mut CudaSlice<T> = cs.as_cuda_slice_mut::<T>()?;
        let n = s.len();
        // SAFETY: as in `bytes`; every byte pattern is a valid element of these dtypes.
        unsafe { s.transmute_mut::<u8>(n * size) }
            .ok_or_else(|| Error::invalid("nccl", "internal: byte view out of range"))
    })
}

struct Ready(Vec<Tensor>);

impl PendingOp for Ready {
    fn wait(self: Box<Self>) -> Result<Vec<Tensor>> {
        Ok(self.0)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_reduce");
        let kind = OpKind::AllReduce;
        let home = x.device().clone();
        let x = self.on_device(kind.name(), x)?;
        let out = p2p::all_reduce(self, &x, op)?;
        let bounds = chunk_bounds(x.elem_count(), self.size);
        self.traffic
            .record_all_reduce(&bounds, self.rank, x.dtype().size_in_bytes() as u64);
        Self::home(out, &home)
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_gather");
        let kind = OpKind::AllGather;
        let home = x.device().clone();
        let x = self.on_device(kind.name(), x)?;
        let out = p2p::all_gather(self, &x, dim)?;
        let b = payload_bytes(&x) * (self.size as u64 - 1);
        self.traffic.record(kind, b, b);
        Self::home(out, &home)
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("reduce_scatter");
        let kind = OpKind::ReduceScatter;
        let home = x.device().clone();
        let x = self.on_device(kind.name(), x)?;
        let out = p2p::reduce_scatter(self, &x, dim, op)?;
        self.traffic
            .record_symmetric(kind, payload_bytes(&x) / self.size as u64, self.size);
        Self::home(out, &home)
    }

    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_to_all");
        let kind = OpKind::AllToAll;
        let home = x.device().clone();
        let x = self.on_device(kind.name(), x)?;
        let out = p2p::all_to_all(self, &x, split_dim, concat_dim)?;
        self.traffic
            .record_symmetric(kind, payload_bytes(&x) / self.size as u64, self.size);
        Self::home(out, &home)
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("broadcast");
        let kind = OpKind::Broadcast;
        let home = x.device().clone();
        let x = self.on_device(kind.name(), x)?;
        let out = p2p::broadcast(self, &x, root)?;
        let b = payload_bytes(&x);
        if self.rank == root {
            self.traffic.record(kind, b * (self.size as u64 - 1), 0);
        } else {
            self.traffic.record(kind, 0, b);
        }
        Self::home(out, &home)
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let _comm = super::traffic::CommTimer::start("send");
        check_rank(OpKind::Send.name(), "destination", dst, self.size)?;
        if dst == self.rank {
            return Err(Error::invalid("send", "a send to this rank itself"));
        }
        self.group_p2p(&[(dst, x.clone())], &[])?;
        self.traffic.record_send(x, self.rank, dst);
        Ok(())
    }

    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("recv");
        check_rank(OpKind::Recv.name(), "source", src, self.size)?;
        if src == self.rank {
            return Err(Error::invalid("recv", "a receive from this rank itself"));
        }
        let mut got = self.group_p2p(&[], &[RecvSpec::new(src, shape.clone(), dtype)])?;
        let t = got
            .pop()
            .ok_or_else(|| Error::invalid("recv", "internal: nothing received"))?;
        self.traffic.record_recv(&t, self.rank, src);
        Ok(t)
    }

    fn exchange(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Pending> {
        let _comm = super::traffic::CommTimer::start("exchange");
        check_exchange(&sends, &recvs, self.size)?;
        // NCCL's group runs asynchronously on the stream: the received tensors are ready for
        // every later kernel on it, so the handle is complete at once.
        self.traffic.record_exchange(&sends, &recvs, self.rank);
        let got = p2p::exchange(self, sends, recvs)?;
        Ok(Pending::new(Box::new(Ready(got))))
    }

    fn barrier(&self) -> Result<()> {
        let _comm = super::traffic::CommTimer::start("barrier");
        let one = Tensor::ones(1, DType::F32, &self.device())?;
        let _ = self.all_reduce(&one, ReduceOp::Sum)?;
        BackendDevice::synchronize(&self.dev)?;
        self.traffic.record(OpKind::Barrier, 0, 0);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Comm> {
        let (plan, id) = split_ids(self, color, key, &self.device(), new_id)?;
        let raw = RawNccl::from_rank(
            self.dev.cuda_stream(),
            plan.rank,
            plan.size(),
            id_from_bytes(&id),
        )
        .map_err(|e| nccl_err("ncclCommInitRank (split)", e))?;
        self.traffic.record(OpKind::Split, 0, 0);
        Ok(Arc::new(NcclComm {
            raw: Raw(Mutex::new(raw)),
            dev: self.dev.clone(),
            rank: plan.rank,
            size: plan.size(),
            world_rank: self.world_rank,
            traffic: self.traffic.clone(),
        }))
    }

    fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    fn world_rank(&self) -> usize {
        self.world_rank
    }
}
