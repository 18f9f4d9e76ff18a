"""``bench/kernel_profile``: kernel names to classes, and the per-class totals of one profiled call."""

from patchray.distributed.bench.kernel_profile import classify, summarise


def test_kernel_names_from_an_h200_profile_fall_in_their_classes():
    names = {
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0": "attention",
        "Memcpy HtoD (Pinned -> Device)": "memcpy",
        "Memset (Device)": "memset",
        "at::cuda::(anonymous namespace)::spin_kernel(long)": "spin",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2u>, unsigned int, 4, 64, 64>": "cat/copy",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>": "norm/reduce",
        "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl>": "elementwise",
        "triton_poi_fused_gelu_view_2": "other",
    }
    for name, cls in names.items():
        assert classify(name) == cls, name


def test_summary_totals_by_class_and_leaves_the_spin_out():
    events = [("spin_kernel(long)", 5000.0), ("nvjet_sm90_gemm", 1500.0), ("nvjet_sm90_gemm", 500.0),
              ("Memcpy DtoH (Device -> Pinned)", 250.0)]
    s = summarise(events, top=2)
    assert s["gpu_ms"] == 7.25 and s["gpu_ms_without_spin"] == 2.25
    assert s["by_class"]["gemm"] == {"ms": 2.0, "kernels": 2}
    assert s["device_events"] == 3
    assert [t["name"] for t in s["top"]] == ["spin_kernel(long)", "nvjet_sm90_gemm"]
