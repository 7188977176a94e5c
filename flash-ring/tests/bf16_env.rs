//! `FLASH_RING_BF16` is read once per process, so its bad value has a test binary of its own:
//! every product and attention under the default choice (`Bf16Products::Auto`) fails with an
//! error naming the variable, its value and the choices, and never panics; an explicit choice
//! is unaffected.

use candle_core::{DType, Device, Tensor};
use flash_ring::{AttnSpec, Bf16Products, KernelConfig, MaskKind};

#[test]
fn a_bad_flash_ring_bf16_is_an_error_naming_it() {
    // This binary's only test sets the variable before any product reads it.
    std::env::set_var(flash_ring::cpu::gemm_bf16::BF16_ENV, "fast");
    let named = |e: String| {
        assert!(
            e.contains("FLASH_RING_BF16=\"fast\"") && e.contains("auto, dot or widen"),
            "{e}"
        )
    };
    let x = Tensor::ones((2, 3), DType::BF16, &Device::Cpu).expect("x");
    let w = Tensor::ones((3, 4), DType::BF16, &Device::Cpu).expect("w");
    named(
        flash_ring::matmul(&x, &w)
            .expect_err("bad variable")
            .to_string(),
    );
    let q = Tensor::ones((1, 4, 1, 8), DType::BF16, &Device::Cpu).expect("q");
    let spec = AttnSpec::dense(0.5, MaskKind::Causal, 4, 4);
    named(
        flash_ring::flash_fwd_with_config(&q, &q, &q, &spec, &KernelConfig::default())
            .expect_err("bad variable")
            .to_string(),
    );
    assert!(!flash_ring::bf16_dot_products());
    let widen = KernelConfig {
        bf16: Bf16Products::Widen,
        ..KernelConfig::default()
    };
    let y = flash_ring::matmul_with_config(&x, &w, &widen).expect("an explicit choice");
    assert_eq!(
        y.to_dtype(DType::F32)
            .and_then(|y| y.to_vec2::<f32>())
            .expect("y"),
        vec![vec![3.0f32; 4]; 2]
    );
    flash_ring::flash_fwd_with_config(&q, &q, &q, &spec, &widen).expect("an explicit choice");
}
