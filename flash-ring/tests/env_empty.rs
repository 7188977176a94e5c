//! flash-ring's variables set but empty (`FLASH_RING_BF16=`, `FLASH_RING_ISA=`,
//! `FLASH_RING_GEMM=`, as a shell script's `VAR=$UNSET` gives) mean "unset": the default
//! choices, no error. Each is read once per process, so this is a binary of its own.

use candle_core::{DType, Device, Tensor};
use flash_ring::{AttnSpec, KernelConfig, MaskKind};

#[test]
fn empty_variables_are_unset() {
    // This binary's only test sets the variables before any kernel reads them.
    for var in [
        flash_ring::cpu::gemm_bf16::BF16_ENV,
        flash_ring::cpu::ISA_ENV,
        flash_ring::cpu::mkl::GEMM_ENV,
    ] {
        std::env::set_var(var, "");
    }
    let x = Tensor::ones((3, 5), DType::BF16, &Device::Cpu).expect("x");
    let y = flash_ring::matmul(&x, &x.t().expect("t")).expect("empty means unset");
    assert_eq!(
        y.to_dtype(DType::F32)
            .and_then(|y| y.to_vec2::<f32>())
            .expect("y"),
        vec![vec![5.0f32; 3]; 3]
    );
    assert_eq!(flash_ring::cpu::detect(), flash_ring::cpu::available()[0]);
    let q = Tensor::ones((1, 4, 1, 8), DType::F32, &Device::Cpu).expect("q");
    let spec = AttnSpec::dense(0.5, MaskKind::Causal, 4, 4);
    flash_ring::flash_fwd_with_config(&q, &q, &q, &spec, &KernelConfig::default())
        .expect("empty means unset");
}
