// RUN: hspmd-opt %s -p 'autodiff,clip-grad-norm{max_norm=1.0},adam{lr_input=true decoupled=true},apply-strategy{strategy="[0,1]: dp=2"},propagate-layouts,insert-reshard' | filecheck %s
// RUN: hspmd-opt %s -p 'autodiff,clip-grad-norm{max_norm=1.0},adam{lr_input=true decoupled=true},apply-strategy{strategy="[0,1]: dp=2"},propagate-layouts,insert-reshard,specialize-groups,lower-reshard' | filecheck %s --check-prefix=PHYS

// Data parallel AdamW with clipping: the weight gradient is a partial sum. The optim ops are
// not linear, so it gets exactly one dist.reshard to dup, shared by its sum_squares, its
// clipping and (through it) its update; the clip factor, the lr input, the optimizer states
// and the updates are replicated like the parameter, with no further reshard.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "normal:0.1"} : tensor<4x3xf32>
    %x = graph.input "x" : tensor<8x4xf32>
    %y = graph.matmul %x, %w : (tensor<8x4xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>
    %s = graph.reduce_sum %y {dims = array<i64: 0, 1>} : (tensor<8x3xf32>) -> tensor<f32>
    graph.output "loss", %s : tensor<f32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         [[G:%.*]] = graph.matmul {{.*}} -> tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:    [[GD:%.*]] = dist.reshard [[G]] : tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">> -> tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[SQ:%.*]] = optim.sum_squares [[GD]] : (tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>) -> tensor<f64, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[C:%.*]] = optim.clip_coef [[SQ]]
// CHECK-NEXT:    [[GC:%.*]] = optim.mul_scalar [[GD]], [[C]] : {{.*}} -> tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NOT:     dist.reshard
// CHECK:         [[LR:%.*]] = graph.input "lr" : tensor<f64, #dist.layout<"[0,1]: dup=2">>
// CHECK-NOT:     dist.reshard
// CHECK:         [[M:%.*]] = graph.parameter "opt.m.w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[V:%.*]] = graph.parameter "opt.v.w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    {{%.*}}, {{%.*}}, {{%.*}} = optim.adam %w, [[GC]], [[M]], [[V]], [[LR]], {{.*}} -> (tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>, tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>, tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>)
// CHECK-NOT:     dist.reshard
// CHECK:         func.return

// PHYS:          graph.transpose
// PHYS-NEXT:     graph.matmul {{.*}} -> tensor<4x3xf32>
// PHYS-NEXT:     [[GD:%.*]] = comm.all_reduce {{%.*}} {groups = #dist.groups<"{0,1}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// PHYS-NEXT:     optim.sum_squares [[GD]]
// PHYS-NOT:      comm.
// PHYS:          func.return
