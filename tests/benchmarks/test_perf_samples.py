"""benchmarks/perf_samples.py (what benchmarks/tf_runtime_cpu.py reads perf with): literal
`perf script` text, as perf printed it for a 2-process pipeline (symbols shortened where long),
and the class each sample belongs to."""
from benchmarks.perf_samples import classify, parse_samples

TF = "(/v/libtensorflow_cc.so.2)"
FRAMEWORK = "(/v/libtensorflow_framework.so.2)"
KERNEL = "([kernel.kallsyms])"

PERF_SCRIPT = f"""    0
\tffffffff8224215b pv_native_safe_halt {KERNEL}
\tffffffff82243c75 default_idle {KERNEL}

 8713
\t    7efcdeb649a4 [unknown] (/tmp/perf-8713.map)
\tbfac29463e96e8eb [unknown] ([unknown])

 8621
\t    2511 std::_Function_handler<void (long, long), Eigen::internal::TensorExecutor<\
Eigen::TensorAssignOp<scalar_sum_op<float const, float const> > >::_M_invoke {TF}
\t    2512 Eigen::ThreadPoolDevice::parallelFor {FRAMEWORK}
\t    2513 tensorflow::AssignUpdateVariableOp<Eigen::ThreadPoolDevice, float, \
(tensorflow::DenseUpdateType)0>::Compute {TF}
\t    2514 tensorflow::ThreadPoolDevice::Compute {FRAMEWORK}

 8621
\t    2521 std::_Function_handler<void (long, long), \
Eigen::internal::TensorExecutor<scalar_sum_op> >::_M_invoke {TF}
\t    2522 tensorflow::BinaryOp<Eigen::ThreadPoolDevice, \
tensorflow::functor::add<float> >::Compute {TF}
\t    2523 tensorflow::ThreadPoolDevice::Compute {FRAMEWORK}

 8713
\t    2531 dnnl::impl::cpu::x64::gemm_kernel_driver<float, float, float> {TF}
\t    2532 tensorflow::MklMatMulOp<Eigen::ThreadPoolDevice, float, false>::Compute {TF}

 8713
\tffffffff8100 _copy_to_iter {KERNEL}
\tffffffff8101 tcp_recvmsg {KERNEL}
\t    2541 grpc_core::ExecCtx::Flush {TF}

 8713
\t    2551 tensorflow::BaseRemoteRendezvous::Send {FRAMEWORK}
\t    2552 tensorflow::SendOp::Compute {FRAMEWORK}

 8621
\t    2561 _int_free (/usr/lib/x86_64-linux-gnu/libc.so.6)
\t    2562 tensorflow::Tensor::~Tensor {FRAMEWORK}
\t    2563 tensorflow::PartitionedCallOp::ComputeAsync {TF}

 8621
\tffffffff8200 finish_task_switch.isra.0 {KERNEL}
\tffffffff8201 schedule {KERNEL}

 8713
\t    2571 _PyEval_EvalFrameDefault (/v/libpython3.12.so.1.0)
"""


def test_each_sample_is_read_with_its_pid_frames_and_leaf_dso():
    read = list(parse_samples(PERF_SCRIPT))
    assert [pid for pid, _, _ in read] == [0, 8713, 8621, 8621, 8713, 8713, 8713, 8621, 8621,
                                           8713]
    assert [len(frames) for _, frames, _ in read] == [2, 2, 4, 3, 2, 3, 2, 3, 2, 1]
    assert [dso for _, _, dso in read][:3] == ["[kernel.kallsyms]", "/tmp/perf-8713.map",
                                               "/v/libtensorflow_cc.so.2"]


def test_each_sample_falls_in_its_class():
    classes = [classify(frames, dso) for pid, frames, dso in parse_samples(PERF_SCRIPT)
               if pid != 0]
    assert classes == [
        "matmul",                       # oneDNN's generated code (perf's JIT map)
        "op AssignUpdateVariableOp",    # an in-place add: the op that runs the Eigen loop
        "op BinaryOp<add>",             # the functor names a BinaryOp
        "matmul",                       # oneDNN's driver, under MatMul
        "transfer",                     # the OS kernel's TCP under gRPC
        "transfer",                     # a Send into the rendezvous
        "runtime",                      # the allocator, under no op but a function call
        "OS kernel",                    # scheduling
        "python",
    ]
