// RUN: hspmd-opt %s -p 'autodiff,sgd{lr=0.1},apply-strategy{strategy="[0,1]: dp=2 zero=3"},apply-annotations,shard-optimizer-state,shard-parameters' | filecheck %s

// zero=3: every parameter split over dp (a stacked one along a dim after its layers); each is
// gathered where it is computed with: at the top of the layer's forward and again in its
// backward (the scan passes the shard), before each read in the step (the head: once in the
// forward, once in the backward); the update reads the shard; a stacked gradient is scattered
// into its shard inside the backward scan, before the layer's backward returns it.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "l.[0:3].w" {init = "normal:0.02"} : tensor<3x4x4xf32>
    %h0 = graph.parameter "head" {init = "normal:0.02"} : tensor<4x2xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %h = graph.scan @Layer_0(%w, %x) {length = 3 : i64, stacked = array<i64: 0>, carry_args = array<i64: 1>, carry_results = array<i64: 0>} : (tensor<3x4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %o = graph.matmul %h, %h0 : (tensor<2x4xf32>, tensor<4x2xf32>) -> tensor<2x2xf32>
    %l = graph.reduce_sum %o {dims = array<i64: 0, 1>} : (tensor<2x2xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
  func.func private @Layer_0(%w: tensor<4x4xf32>, %x: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %a = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    %t = graph.tanh %a : (tensor<2x4xf32>) -> tensor<2x4xf32>
    func.return %t : tensor<2x4xf32>
  }
}

// CHECK:       %w = graph.parameter "l.[0:3].w" {{.*}} : tensor<3x4x4xf32, #dist.layout<"[0,1]: split(1)=2">>
// CHECK:       %h0 = graph.parameter "head" {{.*}} : tensor<4x2xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK:       graph.scan @Layer_0_fwd(%w, %x)
// CHECK:       [[G1:%.*]] = dist.reshard %h0 : {{.*}} -> tensor<4x2xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:  graph.matmul %h, [[G1]]
// CHECK:       graph.output "loss"
// CHECK:       [[G2:%.*]] = dist.reshard %h0 : {{.*}} -> tensor<4x2xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:  graph.transpose [[G2]]
// CHECK:       graph.scan @Layer_0_bwd({{.*}}, %w, {{.*}})
// CHECK:       optim.sgd %w,
// CHECK:       optim.sgd %h0,
// CHECK-LABEL: func.func private @Layer_0_bwd
// CHECK-SAME:    -> (tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<2x4xf32>)
// CHECK:         dist.reshard %w : tensor<4x4xf32> -> tensor<4x4xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK:         [[DW:%.*]] = dist.reshard {{%.*}} : tensor<4x4xf32> -> tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:    func.return [[DW]]
// CHECK-LABEL: func.func private @Layer_0_fwd
// CHECK-NEXT:    [[W:%.*]] = dist.reshard %w : tensor<4x4xf32> -> tensor<4x4xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.matmul %x, [[W]]
