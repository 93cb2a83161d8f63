// RUN: hspmd-opt %s -p reuse-resharded-residuals | filecheck %s

// @F_fwd reshards %a into split(0) (an all-to-all) and returns %a as a residual, which @F_bwd
// reshards into split(0) again: the forward now returns the resharded value and the backward
// uses it as it comes. %b is gathered in the backward (dup, a larger piece): it stays split.

#s0 = #dist.layout<"[0,1]: split(0)=2">
#s1 = #dist.layout<"[0,1]: split(1)=2">
#dup = #dist.layout<"[0,1]: dup=2">
builtin.module {
  func.func @train_step() {
    %x = graph.input "x" : tensor<4x4xf32, #s1>
    %y, %ra, %rb = func.call @F_fwd(%x) : (tensor<4x4xf32, #s1>) -> (tensor<4x4xf32, #s0>, tensor<4x4xf32, #s1>, tensor<4x4xf32, #s1>)
    %g = func.call @F_bwd(%y, %ra, %rb) : (tensor<4x4xf32, #s0>, tensor<4x4xf32, #s1>, tensor<4x4xf32, #s1>) -> tensor<4x4xf32, #s0>
    graph.output "g", %g : tensor<4x4xf32, #s0>
    func.return
  }
  func.func private @F_fwd(%a: tensor<4x4xf32, #s1>) -> (tensor<4x4xf32, #s0>, tensor<4x4xf32, #s1>, tensor<4x4xf32, #s1>) {
    %r = dist.reshard %a : tensor<4x4xf32, #s1> -> tensor<4x4xf32, #s0>
    %b = graph.tanh %a : (tensor<4x4xf32, #s1>) -> tensor<4x4xf32, #s1>
    %t = graph.tanh %r : (tensor<4x4xf32, #s0>) -> tensor<4x4xf32, #s0>
    func.return %t, %a, %b : tensor<4x4xf32, #s0>, tensor<4x4xf32, #s1>, tensor<4x4xf32, #s1>
  }
  func.func private @F_bwd(%dy: tensor<4x4xf32, #s0>, %a: tensor<4x4xf32, #s1>, %b: tensor<4x4xf32, #s1>) -> tensor<4x4xf32, #s0> {
    %r = dist.reshard %a : tensor<4x4xf32, #s1> -> tensor<4x4xf32, #s0>
    %m = graph.mul %dy, %r : (tensor<4x4xf32, #s0>, tensor<4x4xf32, #s0>) -> tensor<4x4xf32, #s0>
    %bd = dist.reshard %b : tensor<4x4xf32, #s1> -> tensor<4x4xf32, #dup>
    %bs = dist.reshard %bd : tensor<4x4xf32, #dup> -> tensor<4x4xf32, #s0>
    %n = graph.mul %m, %bs : (tensor<4x4xf32, #s0>, tensor<4x4xf32, #s0>) -> tensor<4x4xf32, #s0>
    func.return %n : tensor<4x4xf32, #s0>
  }
}

// CHECK:       %y, %ra, %rb = func.call @F_fwd(%x) : {{.*}} -> (tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<4x4xf32, #dist.layout<"[0,1]: split(1)=2">>)
// CHECK:       func.func private @F_fwd
// CHECK:         %r = dist.reshard %a
// CHECK:         func.return %t, %r, %b
// CHECK:       func.func private @F_bwd(%dy: {{.*}}, %a: tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>, %b: tensor<4x4xf32, #dist.layout<"[0,1]: split(1)=2">>)
// CHECK-NOT:     dist.reshard %a
// CHECK:         %m = graph.mul %dy, %a
// CHECK:         %bd = dist.reshard %b
