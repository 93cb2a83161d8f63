// RUN: hspmd-opt %s -p 'autodiff,adam{lr=0.01},apply-strategy{strategy="[0,1]: dp=2 zero=2"},shard-optimizer-state,propagate-layouts,insert-reshard' | filecheck %s
// RUN: hspmd-opt %s -p 'autodiff,adam{lr=0.01},apply-strategy{strategy="[0,1]: dp=2 zero=2"},shard-optimizer-state,propagate-layouts,insert-reshard,specialize-groups,lower-reshard' | filecheck %s --check-prefix=PHYS
// RUN: hspmd-opt %s -p 'autodiff,adam{lr=0.01},apply-strategy{strategy="[0,1]: dp=2"},shard-optimizer-state' | filecheck %s --check-prefix=OFF

// ZeRO: the moments of w [4, 3] are split along dim 0 over dp; those of b [3] (dp=2 divides no
// dim) and the scalar states stay replicated like their parameters. The elementwise update then
// runs on the shards: the partial gradient is reduce-scattered, the replicated parameter sliced
// locally, and the updated shard all-gathered for the assign of w (no all-reduce of w's gradient).
// Without zero the pass changes nothing.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "normal:0.1"} : tensor<4x3xf32>
    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32>
    %x = graph.input "x" : tensor<8x4xf32>
    %y = graph.matmul %x, %w : (tensor<8x4xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>
    %bb = graph.broadcast %b {dims = array<i64: 1>} : (tensor<3xf32>) -> tensor<8x3xf32>
    %z = graph.add %y, %bb : (tensor<8x3xf32>, tensor<8x3xf32>) -> tensor<8x3xf32>
    %s = graph.reduce_sum %z {dims = array<i64: 0, 1>} : (tensor<8x3xf32>) -> tensor<f32>
    graph.output "loss", %s : tensor<f32>
    func.return
  }
}

// CHECK:      graph.parameter "w" {{.*}} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK:      [[G:%.*]] = graph.matmul {{.*}} -> tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">>
// CHECK:      [[M:%.*]] = graph.parameter "opt.m.w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT: [[V:%.*]] = graph.parameter "opt.v.w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT: [[WS:%.*]] = dist.reshard %w : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">> -> tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT: [[GS:%.*]] = dist.reshard [[G]] : tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">> -> tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT: [[NW:%.*]], {{%.*}}, {{%.*}} = optim.adam [[WS]], [[GS]], [[M]], [[V]], {{.*}} -> (tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">>)
// CHECK-NEXT: [[NWD:%.*]] = dist.reshard [[NW]] : tensor<4x3xf32, #dist.layout<"[0,1]: split(0)=2">> -> tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT: graph.assign "w", [[NWD]]
// CHECK:      graph.parameter "opt.m.b" {init = "zeros"} : tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT: graph.parameter "opt.v.b" {init = "zeros"} : tensor<3xf32, #dist.layout<"[0,1]: dup=2">>

// PHYS:      graph.parameter "opt.m.w" {{.*}} : tensor<2x3xf32>
// PHYS:      comm.local_split %w {groups = #dist.groups<"{0,1}">, dim = 0 : i64} : tensor<4x3xf32> -> tensor<2x3xf32>
// PHYS-NEXT: comm.reduce_scatter {{%.*}} {groups = #dist.groups<"{0,1}">, dim = 0 : i64} : tensor<4x3xf32> -> tensor<2x3xf32>
// PHYS-NEXT: [[NW:%.*]], {{%.*}}, {{%.*}} = optim.adam {{.*}} -> (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>)
// PHYS-NEXT: [[NWD:%.*]] = comm.all_gather [[NW]] {groups = #dist.groups<"{0,1}">, dim = 0 : i64} : tensor<2x3xf32> -> tensor<4x3xf32>
// PHYS-NEXT: graph.assign "w", [[NWD]] : tensor<4x3xf32>
// PHYS-NOT:  comm.
// PHYS:      func.return

// OFF:     graph.parameter "opt.m.w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
